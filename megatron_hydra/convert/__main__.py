"""``python -m megatron_hydra.convert from_hf|to_hf|from_megatron|to_megatron key=value ...``

    from_hf input=HF_DIR output=CKPT_DIR [parallel=single|tp2|tp2_pp2|...] [name=MODEL_NAME]
    from_hf input=PEFT_ADAPTER_DIR base=BASE_CKPT output=ADAPTER_CKPT [parallel=...]
    to_hf   input=CKPT_DIR output=HF_DIR [dtype=float32|bfloat16|float16|float64] (default: the checkpoint's own)
    to_hf   input=BASE_CKPT adapter=ADAPTER_CKPT merge=true output=HF_DIR [dtype=...]   (LoRA merged in)
    to_hf   input=ADAPTER_CKPT output=PEFT_DIR [base=HF_NAME_OR_DIR] [dtype=...]      (a peft adapter directory)
    from_megatron input=MEGATRON_SAVE_DIR output=CKPT_DIR [parallel=...] [name=...] [iteration=N]
                  (Megatron-LM / Megatron-Core: torch_dist or legacy per-rank files; docs/megatron.md)
    to_megatron   input=CKPT_DIR output=MEGATRON_DIR   (torch_dist, for Megatron-Core's dist_checkpointing)

Families: GPT-2, Llama (3.1+ RoPE scaling), Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Gemma 2 and Gemma 3
(our GPT), BERT, T5; LoRA adapters merged, or as peft adapter directories (docs/hf_interop.md).

Arguments are Hydra-style ``key=value`` overrides, typed by the dataclasses below, so a misspelled
key is a one-line error. Errors print one line and exit with status 2.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import List, Optional

from omegaconf import MISSING

from megatron_hydra.config.cli import parse_args
from megatron_hydra.errors import MegatronHydraError, one_line


@dataclass
class FromHF:
    input: str = MISSING
    output: str = MISSING
    parallel: str = "single"
    name: Optional[str] = None
    base: Optional[str] = None  # the base checkpoint of a peft adapter directory


@dataclass
class ToHF:
    input: str = MISSING
    output: str = MISSING
    dtype: Optional[str] = None
    adapter: Optional[str] = None  # an adapter checkpoint to merge into input (merge=true)
    merge: bool = False
    base: Optional[str] = None  # a peft adapter directory's base model (name or directory), recorded


@dataclass
class FromMegatron:
    input: str = MISSING
    output: str = MISSING
    parallel: str = "single"
    name: Optional[str] = None
    iteration: Optional[int] = None  # default: latest_checkpointed_iteration.txt


@dataclass
class ToMegatron:
    input: str = MISSING
    output: str = MISSING


COMMANDS = {"from_hf": FromHF, "to_hf": ToHF, "from_megatron": FromMegatron, "to_megatron": ToMegatron}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    from megatron_hydra.convert import api

    try:
        args = parse_args(COMMANDS[argv[0]], argv[1:])
        if argv[0] in ("from_megatron", "to_megatron"):
            from megatron_hydra.convert import megatron

            print(megatron.from_megatron(args.input, args.output, args.parallel, args.name, args.iteration)
                  if argv[0] == "from_megatron" else megatron.to_megatron(args.input, args.output))
        elif argv[0] == "from_hf":
            command = api.from_hf(args.input, args.output, args.parallel, args.name, args.base)
            print(f"imported {args.input} -> {args.output}\nfine-tune it with:\n  {command}")
        else:
            result = api.to_hf(args.input, args.output, args.dtype, adapter=args.adapter, merge=args.merge,
                               base=args.base)
            print(f"exported {args.input} -> {args.output} ({result['architecture']}: {', '.join(result['files'])})")
    except MegatronHydraError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
