"""The EAGLE-3 draft: its architecture and tensor shape contract (arch), the config layouts that
vLLM, speculators and SGLang read (formats) and their parsing back (parsing), and the checkpoint
check (checkpoint)."""
