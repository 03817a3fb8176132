"""The model: architecture config, weights loading (HF folders, GGUF), tokenizer, torch forward."""
