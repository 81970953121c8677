"""`cnns benchmark`, `cnns profile`, `cnns bench-data` and train.py --dataset-benchmark: the benchmarks.yml
entries run beside the plain PyTorch loop, an update's time by operator family, and the input pipeline
alone."""

from __future__ import annotations

from typing import Any, Callable

from cnns.errors import ConfigError


def benchmark(spec: str, names: list[str] | None, output_dir: str, data_dir: str | None, listing: bool,
              repeats: int | None, baseline: bool, keep_runs: bool,
              script_options: Callable[[str, list[str]], dict[str, Any]]) -> int:
    """Each entry's command line (train.py or validation.py, as Graphcore's application takes them) is resolved
    by `script_options` (the command line's own resolution)."""
    from cnns.bench.runner import BenchmarkSuite

    suite = BenchmarkSuite(spec, names, output_dir, data_dir)
    if listing:
        print("\n".join(suite.listing()))
        return 0
    options = {name: script_options(script, args) for name, (script, args) in suite.entry_commands().items()}
    return suite.run(options, repeats=repeats, baseline=baseline, keep_runs=keep_runs)


def profile(spec: str, names: list[str], updates: int, output_dir: str, data_dir: str | None,
            script_options: Callable[[str, list[str]], dict[str, Any]], eager_too: bool = False) -> int:
    """CPU entries by operator family, CUDA entries by GPU kernel family against the GPU's rooflines; with
    `eager_too`, a CUDA entry that compiles is profiled again without compilation (--no-compile)."""
    from cnns.bench import gpuprofile, opprofile
    from cnns.bench.runner import BenchmarkSuite, plan_entry

    if updates < 1:
        raise ConfigError(f"--updates must be at least 1, got {updates}")
    suite = BenchmarkSuite(spec, names, output_dir, data_dir)  # a CUDA entry without a GPU: skipped, one line
    plans = []
    for entry in suite.entries:
        script, script_args = suite.entry_commands().get(entry.name, ("", []))
        if script != "train.py":
            raise ConfigError(f"benchmark {entry.name}: cnns profile takes training entries (train.py)")
        folder = suite.run_dir / entry.name
        warmup = gpuprofile.CUDA_WARMUP if entry.device != "cpu" else 1  # compilation, CUDA-graph recording
        script_args = script_args + opprofile.profile_arguments(updates, folder, warmup)
        options = script_options(script, script_args)
        plans.append((entry, folder, warmup, bool(options.get("compile")),
                      plan_entry(entry, script, script_args, options)))
    for name, why in suite.skipped.items():
        print(f"{name}: skipped, {why}", flush=True)
    for entry, folder, warmup, compiles, plan in plans:
        eager = eager_too and entry.device != "cpu" and compiles
        if eager_too and not eager:
            why = "runs on the CPU" if entry.device == "cpu" else "does not compile"
            print(f"{entry.name}: --eager-too adds nothing: it {why}", flush=True)
        sides = "each side" + (" and cnns eager" if eager else "")
        print(f"{entry.name}: profiling {updates} updates of {sides} after {warmup} warm-up ...", flush=True)
        spec_dir = suite.spec_path.resolve().parent
        if entry.device == "cpu":
            print(opprofile.format_report(opprofile.profile_entry(entry.name, plan, spec_dir, folder, entry.timeout,
                                                                  warmup=warmup)), flush=True)
        else:
            print(gpuprofile.format_gpu_report(gpuprofile.profile_cuda_entry(
                entry.name, plan, spec_dir, folder, entry.timeout, eager=eager, warmup=warmup)), flush=True)
    print(f"traces and logs: {suite.run_dir}")
    return 0


def bench_data(request) -> int:
    """`cnns bench-data`: `request` is a `cnns.bench.data.BenchDataRequest`."""
    from cnns.bench.data import bench_data_command

    return bench_data_command(request)


def dataset_benchmark(cfg, notices: list[str]) -> int:
    """train.py --dataset-benchmark (an option of Graphcore's application): the run's training input pipeline
    alone, as the run would build it, for the run's length; no model, no run folder. `cfg` is the run's
    `cnns.config.RunConfig`."""
    from cnns.bench.data import dataset_benchmark as time_the_pipeline
    from cnns.commands.checks import check_data_before_writing, check_no_sinks_without_a_folder, check_optional_parts

    check_no_sinks_without_a_folder(cfg, "train.py --dataset-benchmark writes no run folder")
    check_optional_parts(cfg)  # where its images are decoded: the run's rule
    check_data_before_writing(cfg, train=True, evaluation=False)  # only the training pipeline is timed
    for notice in notices:
        print(notice)
    time_the_pipeline(cfg)
    return 0
