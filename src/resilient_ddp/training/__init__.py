"""Training: ``ResilientDDP`` and elastic training (shrink to the survivors, take
replacements back), with its pure decisions and its batch sampler."""
