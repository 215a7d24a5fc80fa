"""Checkpoints: the on-disk format (format.py), saving and loading with a strategy (manager.py), which
checkpoint a run resumes from (resume.py), other formats in and out (convert.py), weights for inference
(export.py)."""
