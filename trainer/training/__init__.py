"""One run's life: a rank joins and leaves (run.py), the loop (loop.py), its step bookkeeping (steps.py),
the learning rate (schedule.py), faults and stops (faults.py), and where records go (loggers.py)."""
