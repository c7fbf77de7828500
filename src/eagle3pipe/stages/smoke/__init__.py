"""The smoke stage: real vLLM speculative decoding of the exports (run), its inputs, engines,
acceptance, speed and training-vs-serving agreement."""
