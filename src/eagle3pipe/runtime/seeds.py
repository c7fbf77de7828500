"""Fixed seeds and explicit thread counts: content addressing only pays when the same params
give the same bytes."""
from __future__ import annotations

import os
import random


def seed_everything(seed: int, threads: int) -> None:
    """Fixed seeds and an explicit thread count: same params, same bytes."""
    import numpy as np
    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
