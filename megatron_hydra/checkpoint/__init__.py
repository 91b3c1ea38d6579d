"""Sharded, layout-free checkpoints: ``store`` (directories, atomic commit), ``sharded`` (DCP
save/load with resharding), ``rng`` (per-rank generator states), ``callback`` (Lightning wiring)."""
