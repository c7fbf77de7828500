"""The dataset stage: prompts and the verifier's regenerated replies, tokenized with loss masks."""
