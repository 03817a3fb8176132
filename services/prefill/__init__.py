"""The prefill service: computes prompts and streams their KV to the store layer by layer."""
