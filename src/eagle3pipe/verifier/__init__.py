"""The verifier: the one reader of its files (handle), its fingerprint, the model families it can
be, the preflight that refuses what cannot run, and the embedded default's builder."""
