"""Process plumbing every stage shares: atomic outputs, JSON, seeds, disk, units, torch.distributed."""
