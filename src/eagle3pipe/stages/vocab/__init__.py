"""The vocab stage: token frequencies -> the draft vocabulary's d2t/t2d maps."""
