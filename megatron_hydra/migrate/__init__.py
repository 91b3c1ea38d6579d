"""Megatron-LM command lines as launch.py overrides: ``python -m megatron_hydra.migrate -- <flags>``.

``shell`` (with ``shell_lexer`` and ``shell_eval``) reads the training command out of a script
without running it, at a bounded cost; ``command_line`` splits it into launcher, script and flags
as argparse would; ``translate`` (with ``model_flags`` and ``data_flags``) gives each flag its
meaning here, by Megatron-LM's own rules and defaults (``flags``); ``presets`` turns the result
into overrides (presets where they match exactly) and a model YAML; ``check`` composes and derives
it, and runs ``mode=plan`` and a dry run; ``report`` prints it. docs/megatron.md.
"""
