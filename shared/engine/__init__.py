"""The inference engine: requests, scheduling, model runner, sampling, detokenization."""
