"""``asyncrl train | sft | dpo | eval | train-draft | print-config | bench``: parse arguments, call the library.

Every config subcommand takes an optional recipe (a path or a name under recipes/)
followed by dotted overrides: ``asyncrl train quickstart rollout.n=4 algorithm.kl_coef=0.01``.
``asyncrl bench NAME [flags]`` runs a benchmark with its own flags (``--help``).
"""
from __future__ import annotations

import argparse
import logging
import sys

from asyncrl.config import ConfigError, config_to_yaml, load_config
from asyncrl.data.datasets import DatasetError
from asyncrl.data.templates import TemplateError
from asyncrl.distributed.group import check_local_ranks
from asyncrl.runtime.validate import validate_config

DEFAULT_RECIPE = "quickstart"


def _split(args: list[str]) -> tuple[str, list[str]]:
    """(recipe, overrides): the first argument is a recipe unless it is an override."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return DEFAULT_RECIPE, args


def _cmd_train(cfg) -> int:
    from asyncrl.runtime.pipeline import run_training
    run_training(cfg)
    return 0


def _cmd_sft(cfg) -> int:
    from asyncrl.runtime.sft_job import run_sft_job
    run_sft_job(cfg)
    return 0


def _cmd_eval(cfg) -> int:
    from asyncrl.eval.job import run_eval
    run_eval(cfg)
    return 0


def _cmd_dpo(cfg) -> int:
    from asyncrl.runtime.dpo_job import run_dpo_job
    run_dpo_job(cfg)
    return 0


def _cmd_train_draft(cfg) -> int:
    from asyncrl.runtime.draft_job import run_train_draft
    run_train_draft(cfg)
    return 0


def _cmd_print_config(cfg) -> int:
    print(config_to_yaml(cfg), end="")
    return 0


COMMANDS = {
    "train": (_cmd_train, "run RL training (no arguments: the CPU quickstart)"),
    "sft": (_cmd_sft, "supervised fine-tuning on the task's demonstrations"),
    "eval": (_cmd_eval, "mean@k / pass@k / maj@k of model.path on a dataset's held-out set"),
    "dpo": (_cmd_dpo, "DPO on a jsonl of prompt/chosen/rejected against a frozen reference"),
    "train-draft": (_cmd_train_draft, "train an EAGLE draft head on the policy's own samples (draft.*): "
                                      "rollout.speculative.method=eagle"),
    "print-config": (_cmd_print_config, "print the resolved config tree"),
}


def _bench_rollout(argv: list[str]) -> int:
    from asyncrl.engine.bench import main as rollout_bench
    return rollout_bench(argv)


BENCHMARKS = {"rollout": _bench_rollout}


def _run_bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: asyncrl bench {{{','.join(BENCHMARKS)}}} [flags]", file=sys.stderr)
        return 2
    return BENCHMARKS[argv[0]](argv[1:])


def _launch_ranks(cfg, argv: list[str]) -> int:
    """``trainer.gpus=N``: N local processes, or N Ray actors with ``runtime.executor=ray``."""
    ray = cfg.runtime.executor == "ray"
    try:
        check_local_ranks(cfg.trainer, cfg.trainer.gpus, local=not ray)
    except ConfigError as err:
        print(f"asyncrl: config error: {err}", file=sys.stderr)
        return 2
    if ray:
        import torch

        from asyncrl.distributed.ray_launch import launch_ray

        gpus = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
        return launch_ray(cfg.trainer.gpus, main, argv, gpus=gpus, num_cpus=cfg.runtime.ray_num_cpus)
    from asyncrl.distributed.launch import launch_local

    return launch_local(cfg.trainer.gpus, main, argv)


def config_groups_help() -> str:
    """The config's sections, one line each (the first sentence of its docstring), for ``--help``."""
    import dataclasses

    from asyncrl.config import Config

    lines = ["config groups (override any key as group.key=value; every key with its default and range: "
             "asyncrl print-config [recipe], asyncrl/config.py):"]
    for f in dataclasses.fields(Config):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            doc = " ".join((f.default_factory.__doc__ or "").split("\n\n")[0].split())
            lines.append(f"  {f.name:<10} {doc.split('. ')[0].rstrip('.')}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description="Fast, transparent RL post-training for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=config_groups_help(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("args", nargs="*", help="[recipe] [key.path=value ...]: a recipe name under recipes/ or a "
                                               "YAML path, then dotted overrides, e.g. trainer.steps=200 rollout.n=4")
    sub.add_parser("report", help="write RUN_DIR/report.html (plots, stage profile, health events)",
                   add_help=False)
    sub.add_parser("serve", help="OpenAI-compatible server on the engine (asyncrl serve MODEL_OR_RUN_DIR --help)",
                   add_help=False)
    sub.add_parser("bench", help=f"benchmarks: {', '.join(BENCHMARKS)} (flags: asyncrl bench NAME --help)",
                   add_help=False)
    return parser


def show_info_records() -> None:
    """Print the ``asyncrl`` loggers' INFO records (the engine's KV-pool line, the trainer's
    forward plan) to stderr. Only for the console script: a program that imports asyncrl
    configures logging itself, and tests calling ``main(argv)`` must not stack handlers."""
    log = logging.getLogger("asyncrl")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    """``argv`` None: the process's own arguments (the console script): this process ends with
    the job, so a signal during its teardown exits with the job's status."""
    entry_point = argv is None
    if entry_point:  # this process is the job: a second SIGTERM/SIGINT ends it at once
        from asyncrl.runtime import preemption
        preemption.HARD_EXIT = True
        show_info_records()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":  # benchmarks parse their own flags
        return _run_bench(argv[1:])
    if argv and argv[0] == "serve":  # takes a model or run directory and server flags
        from asyncrl.serve.server import main as serve_main
        return serve_main(argv[1:])
    if argv and argv[0] == "report":  # takes a run directory, not a recipe
        from asyncrl.metrics.report import main as report_main
        return report_main(argv[1:])
    ns = build_parser().parse_args(argv)
    recipe, overrides = _split(ns.args)
    try:
        cfg = load_config(recipe, overrides)
        validate_config(cfg)
    except ConfigError as err:
        print(f"asyncrl: config error: {err}", file=sys.stderr)
        return 2
    if ns.command == "train" and cfg.trainer.gpus > 1:
        from asyncrl.distributed.launch import under_launcher

        if not under_launcher():  # trainer.gpus=N: start the N ranks (each runs this same command)
            return _launch_ranks(cfg, argv)
    return _run_command(ns.command, cfg, entry_point)


def _run_command(command: str, cfg, entry_point: bool = False) -> int:
    """Run a job; a failure is one line on stderr, its traceback in a log file (failures.py).

    Exit codes: 0 done (or preempted: the job checkpointed and said how to resume), 2 a
    config or input refused before training, 1 any other failure, 130 Ctrl-C while loading."""
    from asyncrl.errors import AsyncRLError, ModelLoadError, Preempted, RunDirError
    from asyncrl.runtime.failures import failure_log, one_line, write_traceback

    refused = (ConfigError, DatasetError, TemplateError, FileNotFoundError, ModelLoadError, RunDirError)
    try:
        rc = COMMANDS[command][0](cfg)
        if entry_point:
            _exit_on_late_signals(rc)
        return rc
    except Preempted as err:
        print(f"asyncrl: {err}", file=sys.stderr)
        return 0
    except refused as err:  # found before training starts
        print(f"asyncrl: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("asyncrl: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        log = failure_log(err) or write_traceback(err)
        named = isinstance(err, AsyncRLError)
        cause = one_line(err) if named else f"unexpected {type(err).__name__}: {one_line(err)}"
        print(f"asyncrl: error: {cause} (full traceback: {log})", file=sys.stderr)
        return 1


def _exit_on_late_signals(rc: int) -> None:
    """The job is done (its summary and checkpoint written): a SIGTERM or Ctrl-C during the
    interpreter's teardown ends the process with the job's status, not as killed."""
    import os
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: os._exit(rc))


if __name__ == "__main__":
    sys.exit(main())
