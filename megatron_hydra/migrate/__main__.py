"""A Megatron-LM command line as launch.py overrides:
``python -m megatron_hydra.migrate [options] -- <Megatron-LM command line>``

    -- torchrun ... pretrain_gpt.py --num-layers 24 ...   the command line (with or without its launcher)
    --file SCRIPT      a shell script (examples/gpt3/train_gpt3_175b_distributed.sh) or a file of flags:
                       read without running anything; flags after -- are added after its own
    --output DIR       write the model YAML, when the model is no preset, to DIR/model/<name>.yaml
                       (the command then finds it through hydra.searchpath)
    --name NAME        the model's name (default: <preset>_megatron for a preset's shape, else
                       megatron_<layers>l_<hidden>h)
    --check            also run mode=plan and a one-step mode=dry_run of the result on this machine
    --ranks 0,7        the ranks the dry run simulates (default 0)

Prints the launch.py command, then each flag on one line: the keys it became, or why it needs
none, or why it has no equivalent, or that it is unknown (misspelled or newer than the table);
what a script leaves unknown; and the model YAML when the model is no preset. docs/megatron.md.

Exit status 0 when the printed overrides compose and config.derive accepts them, flags without
equivalent or unknown ones included (each is listed with what changes). Exit status 2, with one
line on stderr, when there is nothing to translate (an option before -- that is not one of the
above, a script that cannot be read or holds no training command), when the overrides do not
compose or do not hold a translated value, when derive refuses the result, or when --check's plan
or dry run fails.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from megatron_hydra.errors import ConfigError, MegatronHydraError, one_line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        raise ConfigError(f"{message}: the Megatron-LM command line goes after -- (see --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m megatron_hydra.migrate", add_help=False)
    parser.add_argument("--file")
    parser.add_argument("--output")
    parser.add_argument("--name")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--ranks")
    parser.add_argument("-h", "--help", action="store_true")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, megatron = argv[:split], argv[split + 1:]
    try:
        opts = _parser().parse_args(own)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if opts.help or (not megatron and not opts.file):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if opts.help else 2
    from megatron_hydra.migrate.check import run_check
    from megatron_hydra.migrate.command import migrate

    try:
        ranks = [int(r) for r in opts.ranks.split(",")] if opts.ranks else None
    except ValueError:
        print(f"error: --ranks {opts.ranks!r}: give global ranks separated by commas, e.g. --ranks 0,7",
              file=sys.stderr)
        return 2
    try:
        result = migrate(megatron, opts.file, opts.name, opts.output)
        print(result.report())
        if result.problem:
            sys.stdout.flush()
            print(f"error: the translated config is refused: {result.problem}", file=sys.stderr)
            return 2
        if opts.check:
            print("\n# --check: mode=plan, then a one-step mode=dry_run")
            sys.stdout.flush()
            run_check(result.config, ranks)
    except MegatronHydraError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
