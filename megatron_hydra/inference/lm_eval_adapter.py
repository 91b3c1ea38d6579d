"""lm-evaluation-harness on the inference engine: benchmark scores of a model at any layout.

``MegatronLM`` is lm-eval's model interface over ``inference.engine.Engine``. It turns text
requests into tokens exactly as lm-eval's own Hugging Face backend (``HFLM``) does, so that the
two score the same tokens: a context's trailing whitespace moves to the continuation and the pair
is tokenised whole (lm-eval's ``TemplateLM``, reused); an empty context becomes the
end-of-document token; a context too long for the model loses its left end; a document scored
whole (``loglikelihood_rolling``) is cut into lm-eval's rolling windows. (Our tokenizers add no
special tokens: a model whose Hugging Face tokenizer starts every text with a BOS token, as
Llama's does, is scored here without it.) Requests go to the engine
in lm-eval's order (longest first, its ``Collator``), generation requests grouped by their
generation arguments, and come back in the order lm-eval asked.

Every rank of the job runs every request (the engine is SPMD: it splits the work over its
data-parallel ranks and hands every rank all results). So each rank tells lm-eval that it is rank
0 of 1, and lm-eval computes the same metrics on every rank without any exchange of its own.

A task is a name lm-eval knows or the path of a task YAML (a task over a local jsonl needs no
network: ``dataset_path: json`` with ``dataset_kwargs: {data_files: ...}``). ``check_tasks`` runs
in the launcher, before any worker starts, so that a misspelt name or a broken file is one line
instead of a failure in every worker.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import stat
from contextlib import ExitStack, contextmanager, redirect_stderr
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple
from unittest import mock

from megatron_hydra.config.schema import EvalConfig, SamplingConfig
from megatron_hydra.errors import ConfigError
from megatron_hydra.inference.sampling import check_sampling

try:
    from lm_eval.api.model import TemplateLM
except ImportError:  # the optional extra ``eval``: every entry point below says how to install it
    TemplateLM = object

INSTALL = "pip install 'megatron-hydra[eval]'"
YAML_SUFFIXES = (".yaml", ".yml")
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for a generate_until task that sets no max_gen_toks
SEED = 1234  # generate_until with do_sample: prompt i of a group draws from seed + i
PART = 512  # requests per engine call (the engine batches, sorts and splits them over data-parallel ranks)


def require_lm_eval() -> None:
    if TemplateLM is object:
        raise ConfigError(f"lm-evaluation-harness is not installed: {INSTALL}")


class MegatronLM(TemplateLM):
    """lm-eval's model interface over an ``Engine``; ``tokenizer`` is ours (``data.tokenizers``),
    ``max_length`` the longest sequence the model takes. ``batch_size`` is what lm-eval records:
    the engine's own sets the forward passes."""

    def __init__(self, engine, tokenizer, max_length: int, batch_size: int = 8, seed: int = SEED):
        require_lm_eval()
        super().__init__()
        self.engine, self.tokenizer, self._max_length = engine, tokenizer, int(max_length)
        self.batch_size, self.seed = int(batch_size), int(seed)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return DEFAULT_MAX_GEN_TOKS

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "path", type(self.tokenizer).__name__)).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
        """Our tokenizers add no special tokens: a document starts where its text starts."""
        return self.tokenizer.encode(string)

    # loglikelihood (TemplateLM tokenises the pairs) and loglikelihood_rolling ----------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[Tuple[float, bool]]:
        """``requests``: (strings or None, context tokens, continuation tokens), scored longest
        first; the engine cuts a pair too long for the model on the left, as HFLM does."""
        from lm_eval.models.utils import Collator

        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        ordered = next(order.get_batched(n=0), [])  # n=0: the whole list, in lm-eval's order
        # Each distinct pair once (tasks repeat requests: an answer's unconditional score, a
        # document in several tasks), as lm-eval's own backend does.
        distinct = list(dict.fromkeys((tuple(c), tuple(x)) for _, c, x in ordered))
        scored: List[Tuple[float, bool]] = []
        for part in _parts(distinct, "loglikelihood", disable_tqdm):
            scored += [(float(logp), bool(greedy)) for logp, greedy in self.engine.score([(list(c), list(x)) for c, x in part])]
        score_of = dict(zip(distinct, scored))
        answers = [score_of[tuple(c), tuple(x)] for _, c, x in ordered]
        for (strings, _, _), answer in zip(ordered, answers):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return order.get_original(answers)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        """Each document's whole log-likelihood: lm-eval's disjoint rolling windows of
        ``max_length`` tokens, the first one after the end-of-document token."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for window in get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.eot_token_id,
                                                    max_seq_len=self.max_length, context_len=1):
                ctx, cont = make_disjoint_window(window)
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # generate_until ---------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        """Continuations until one of the request's ``until`` strings (or end of document), in
        groups of equal generation arguments, each group's prompts longest first."""
        from lm_eval.models.utils import Collator

        order = Collator([req.args for req in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                         group_by="gen_kwargs", group_fn=lambda r: r[1])
        out: List[str] = []
        for group in order.get_batched(n=0):  # n=0: each group whole
            texts = self._generate_group([context for context, _ in group], group[0][1], disable_tqdm)
            for (context, gen_kwargs), text in zip(group, texts):
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.extend(texts)
        return order.get_original(out)

    def _generate_group(self, contexts: Sequence[str], gen_kwargs: dict, disable_tqdm: bool) -> List[str]:
        """One group's texts; its prompt i samples from ``seed + i``, whatever the layout."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tokenizer.decode([self.eot_token_id]))
        max_new = kwargs.pop("max_gen_toks")
        room = self.max_length - max_new
        if room <= 0:
            raise ConfigError(f"a task's max_gen_toks={max_new} leaves no room for a prompt in the model's "
                              f"{self.max_length} positions: lower it in the task's generation_kwargs")
        prompts = [self.tok_encode(c)[-room:] or [self.eot_token_id] for c in contexts]

        def stop(_: int, tokens: List[int]) -> bool:
            text = self.tokenizer.decode(tokens)
            return any(s and s in text for s in until)

        sampling, new, start = sampling_from(kwargs), [], 0
        for part in _parts(prompts, "generate_until", disable_tqdm):
            new += self.engine.generate(part, max_new, sampling, seed=self.seed + start, eod=self.eot_token_id,
                                        stop=stop)
            start += len(part)
        return [postprocess_generated_text(self.tokenizer.decode(t), until, None) for t in new]


def _parts(items: list, what: str, disable_tqdm: bool) -> Iterator[list]:
    """``items`` in consecutive parts of ``PART`` for the engine, with a progress bar over them:
    a long evaluation shows its progress, and lm-eval's order is kept."""
    from tqdm import tqdm

    with tqdm(total=len(items), desc=f"Running {what} requests", disable=disable_tqdm) as bar:
        for start in range(0, len(items), PART):
            yield items[start:start + PART]
            bar.update(min(PART, len(items) - start))


def sampling_from(gen_kwargs: dict) -> SamplingConfig:
    """lm-eval's normalised generation arguments as our sampling: greedy unless ``do_sample``
    with a temperature above zero (as Hugging Face's generate decides)."""
    temperature = float(gen_kwargs.get("temperature") or 0.0)
    if not gen_kwargs.get("do_sample") or temperature <= 0.0:
        return SamplingConfig(greedy=True)
    s = SamplingConfig(greedy=False, temperature=temperature, top_k=int(gen_kwargs.get("top_k") or 0),
                       top_p=float(gen_kwargs.get("top_p") or 1.0))
    check_sampling(s)
    return s


# Tasks ------------------------------------------------------------------------------------------------
def is_task_file(task: str) -> bool:
    """A task given as a file (a YAML suffix or a directory part) rather than a name lm-eval knows."""
    return task.endswith(YAML_SUFFIXES) or os.sep in task or "/" in task


def check_tasks(tasks: List[str], key: str = "trainer.eval.tasks") -> None:
    """One line for a task that cannot run: a name lm-eval does not know, or a task file that is
    missing, not a regular file or not a task YAML lm-eval reads. Cheap for files; a name costs
    lm-eval's index of its own tasks (every YAML it ships), read only when a name is given."""
    require_lm_eval()
    if not tasks:
        raise ConfigError(f"{key} is empty: give lm-eval task names or paths of task YAML files")
    names = []
    for task in tasks:
        if not isinstance(task, str) or not task:
            raise ConfigError(f"{key}: {task!r} is not a task name or a path of a task YAML file")
        if is_task_file(task):
            _check_task_file(task, key)
        else:
            names.append(task)
    unknown = [n for n in names if not _mentioned_by_lm_eval(n)]
    if names and not unknown:
        known = set(_indexed((), True).all_tasks)
        unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"{key}: no task {unknown[0]!r} in lm-eval (`lm-eval ls tasks` lists its names; a local "
                          "task is a path to its YAML file)")


def _check_task_file(path: str, key: str) -> None:
    from lm_eval.tasks._index import TaskIndex

    try:
        st = os.stat(os.path.expanduser(path))
    except OSError:
        raise ConfigError(f"{key}: task file {path} does not exist (give a task YAML file, or a name lm-eval "
                          "knows)") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{key}: task file {path} is not a regular file (give a task YAML file)")
    try:
        entry = TaskIndex.entry_from_path(Path(path))
    except Exception as e:  # noqa: BLE001 - YAML errors, an include that is missing, a shape lm-eval refuses
        raise ConfigError(f"{key}: task file {path} is not a task lm-eval reads ({_first_line(e)}): fix "
                          "the YAML") from None
    if entry is None:
        raise ConfigError(f"{key}: task file {path} names no task (give it a `task:` or `group:` key)")


def _first_line(e: Exception) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def _mentioned_by_lm_eval(name: str) -> bool:
    """Whether ``name`` appears at all in lm-eval's own task YAMLs: every task, group and tag
    name is written in one of them, so a name none mentions is unknown without parsing the
    thousands of files (seconds) that the exact index takes."""
    import lm_eval.tasks

    needle = name.encode()
    for folder, _, files in os.walk(os.path.dirname(lm_eval.tasks.__file__)):
        for file in files:
            if file.endswith(".yaml") and needle in Path(folder, file).read_bytes():
                return True
    return False


def _task_manager(tasks: Sequence[str]):
    """lm-eval's TaskManager for ``tasks``: the directories of task files as its include paths
    (a group there may name the tasks beside it), and lm-eval's own tasks only when a task is
    given by name (indexing them takes seconds)."""
    files = [t for t in tasks if is_task_file(t)]
    folders = tuple(sorted({os.path.dirname(os.path.abspath(os.path.expanduser(f))) for f in files}))
    return _indexed(folders, len(files) < len(tasks))


@functools.lru_cache(maxsize=4)
def _indexed(folders: Tuple[str, ...], include_defaults: bool):
    """One index per process and set of folders: evaluations during training reuse it (the
    index holds names and paths; each task is read anew from its file when loaded)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(folders) or None, include_defaults=include_defaults)


# Evaluation -------------------------------------------------------------------------------------------
def evaluate(engine, tokenizer, max_length: int, eval_cfg: EvalConfig,
             write_to: Optional[str] = None) -> Dict[str, Dict[str, float]]:
    """lm-eval's ``simple_evaluate`` of ``eval_cfg.tasks`` on every rank (the same requests, the
    same results): ``{task: {lm-eval's metric key ("acc,none"): value}}``, numbers only. With
    ``write_to`` (a directory, or a ``.json`` path), rank 0 writes lm-eval's results JSON there
    (``results.json`` in a directory) and prints lm-eval's table."""
    require_lm_eval()
    from lm_eval import simple_evaluate

    tasks = [os.path.abspath(os.path.expanduser(t)) if is_task_file(t) else t for t in eval_cfg.tasks]
    lm = MegatronLM(engine, tokenizer, max_length, eval_cfg.batch_size)
    talks = _rank() == 0
    with _every_rank_is_rank_zero(quiet=not talks):
        results = simple_evaluate(model=lm, tasks=tasks, num_fewshot=eval_cfg.num_fewshot, limit=eval_cfg.limit,
                                  batch_size=eval_cfg.batch_size, task_manager=_task_manager(tasks),
                                  log_samples=False)
    if write_to and talks:
        _write(results, write_to)
    return {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for task, metrics in results["results"].items()}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextmanager
def _every_rank_is_rank_zero(quiet: bool) -> Iterator[None]:
    """lm-eval returns its results only where ``LOCAL_RANK`` is 0 (a tensor-parallel launch's
    first process); here every rank computed them alike and each needs them. ``quiet`` (the
    ranks whose results are never written): lm-eval's progress bars (on stderr) and log lines stay
    on rank 0, and so does its survey of the environment for the results JSON (``pip list`` and
    more in subprocesses: seconds, on every rank at once otherwise)."""
    import lm_eval.evaluator

    saved = os.environ.get("LOCAL_RANK")
    logger = logging.getLogger("lm_eval")
    level = logger.level
    os.environ["LOCAL_RANK"] = "0"
    try:
        with ExitStack() as stack:
            if quiet:
                logger.setLevel(logging.WARNING)
                stack.enter_context(redirect_stderr(stack.enter_context(open(os.devnull, "w"))))
                if hasattr(lm_eval.evaluator, "add_env_info"):
                    stack.enter_context(mock.patch.object(lm_eval.evaluator, "add_env_info", lambda results: None))
            yield
    finally:
        if saved is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved
        logger.setLevel(level)


def _write(results: dict, write_to: str) -> str:
    """lm-eval's results JSON (as its own tracker serialises it) and its table on stdout."""
    from lm_eval.utils import handle_non_serializable, make_table

    path = os.path.expanduser(write_to)
    if not path.endswith(".json"):
        path = os.path.join(path, "results.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
    os.replace(tmp, path)
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    print(f"lm-eval results: {path}")
    return path
