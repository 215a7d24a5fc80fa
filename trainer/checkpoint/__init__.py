"""Checkpoints: the on-disk format (format.py), saving and loading with a strategy (manager.py,
through holder.py: what it needs of one), which checkpoint a run resumes from (resume.py), other
formats in and out (convert.py), weights for inference (export.py)."""
