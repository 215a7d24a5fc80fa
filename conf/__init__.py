"""The Hydra configs. Installed as the package `trainer.conf` (pyproject.toml maps it here), so
`trainer` finds them as `pkg://trainer.conf` from a wheel and from this checkout alike."""
