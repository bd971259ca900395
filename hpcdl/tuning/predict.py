"""Predicting for `hpcdl tune --predict`: one training step's gradient buckets, each one
allreduce per algorithm, from the alpha-beta-gamma model (a tuning file's, or the reference
machine's constants), and the resulting scaling efficiency of synchronous SGD
(docs/cost_model.md). One process, no MPI:

    from hpcdl.tuning import PredictConfig, run_predict
    run_predict(PredictConfig(nodes=256, link=100e9 / 8, latency=2e-6, model_params=25_000_000,
                              compute_ms=120))
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from typing import Any

from ..ddp.bucket_options import DEFAULT_BUCKET_CAP_MB
from ..runtime.atomic_file import write_atomically, write_failure
from .readable import human_bytes, human_seconds


#: Defaults for --predict where no tuning file is given: `collectives.calibrate` on the reference
#: machine (how, and what each number is: docs/design.md, "Facts that shaped the design"). The
#: software latency is this package's Python and MPI cost per message; a cluster's wire adds to it.
DEFAULT_GAMMA = {"float32": 0.05e-9, "float16": 5.3e-9, "bfloat16": 2.0e-9}
DEFAULT_OVERHEAD = 11e-6
DEFAULT_SOFTWARE_LATENCY = 1.5e-6
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


class PredictionInputError(ValueError):
    """What a prediction was given cannot be planned with (a tuning file without a model, a
    timeline that cannot be read, --staged without copy costs); the message names the option."""


@dataclass(frozen=True)
class PredictConfig:
    """The cluster and the training step to plan for; each field is the option of `hpcdl tune
    --predict` of its name, whose parser takes its defaults from here. Bandwidths are in bytes per
    second, times in seconds. `link` and `latency` may come from `tuning_file` instead,
    `model_params` from `timeline`."""

    nodes: int  # ranks in the job, one per node
    compute_ms: float  # compute per step (forward + backward)
    model_params: int | None = None
    link: float | None = None  # per-rank link bandwidth
    latency: float | None = None  # network latency per message (software_latency is added)
    software_latency: float = DEFAULT_SOFTWARE_LATENCY
    dtype: str = "float32"  # the gradients': one of ITEMSIZE
    gamma: float | None = None  # reduction time per byte; None: the tuning file's or DEFAULT_GAMMA
    tuning_file: str | None = None
    bucket_mb: float = DEFAULT_BUCKET_CAP_MB
    timeline: str | None = None  # `hpcdl train --timeline`'s trace: the step replayed with its buckets
    overlap_efficiency: float = 1.0  # the share of the replay's overlap that training gets
    ranks_per_host: int | None = None  # a two-level model: host_link and host_latency within a host
    host_link: float | None = None
    host_latency: float | None = None
    json: str | None = None  # also write the predictions here
    staged: bool = False  # device buffers staged through host memory: copy_* priced
    copy_bandwidth: float | None = None
    copy_latency: float | None = None


@dataclass(frozen=True)
class Buckets:
    """A step's gradient buckets, in closed form (a trillion parameters are a few numbers, not a
    list): `full` buckets of `cap` bytes, then one of `rest` bytes if `rest`."""

    cap: int
    full: int
    rest: int

    @classmethod
    def of(cls, parameters: int, itemsize: int, bucket_mb: float) -> "Buckets":
        """Full buckets of `bucket_mb` MiB (whole elements), then the remainder."""
        total = parameters * itemsize
        cap = max(int(bucket_mb * (1 << 20)) // itemsize * itemsize, itemsize)
        full, rest = divmod(total, cap)
        return cls(cap, full, rest)

    @property
    def count(self) -> int:
        return self.full + (1 if self.rest else 0)

    @property
    def total(self) -> int:
        return self.full * self.cap + self.rest

    def sizes(self) -> list[int]:
        """The distinct bucket sizes, largest first."""
        return ([self.cap] if self.full else []) + ([self.rest] if self.rest else [])


@dataclass(frozen=True)
class StepPrediction:
    """Predicted communication of one training step for one algorithm: one allreduce per bucket,
    `full_s` for each full bucket and `rest_s` for the last, smaller one (if any)."""

    algorithm: str
    buckets: Buckets
    full_s: float
    rest_s: float
    compute_s: float

    @property
    def first_s(self) -> float:
        """The first (largest) bucket's allreduce."""
        return self.full_s if self.buckets.full else self.rest_s

    @property
    def last_s(self) -> float:
        return self.rest_s if self.buckets.rest else self.full_s

    @property
    def total_s(self) -> float:
        return self.buckets.full * self.full_s + (self.rest_s if self.buckets.rest else 0.0)

    @property
    def efficiency_no_overlap(self) -> float:
        return self.compute_s / (self.compute_s + self.total_s)

    @property
    def efficiency_overlap(self) -> float:
        # Every bucket but the last runs while compute does (from the start of the step, at
        # best); the last is ready only when compute ends.
        earlier = self.total_s - self.last_s
        return self.compute_s / (max(self.compute_s, earlier) + self.last_s)


def predict_params(config: PredictConfig) -> tuple[Any, dict[str, str]]:
    """The ModelParams for --predict, and where each came from."""
    from collectives.cost.params import ModelParams
    from collectives.select import model_params

    source: dict[str, str] = {}
    base = None
    if config.tuning_file:
        try:
            base = model_params(config.tuning_file)  # reads and checks the whole file
        except ValueError as exc:
            raise PredictionInputError(str(exc)) from None
        if base is None:
            raise PredictionInputError(f"{config.tuning_file} has no \"model\"; write one with "
                               "`mpirun -n P hpcdl tune -o FILE`")
    software = config.software_latency
    # `hpcdl tune` made sure: without --latency and --link there is a tuning file with a model
    # With a two-level file, --latency and --link describe the network between hosts: they
    # replace its inter-host alpha and beta, and its values within a host stay.
    network = "alpha_inter" if base is not None and base.two_level else "alpha"
    if config.latency is not None:
        alpha = config.latency + software
        source[network] = (f"--latency {human_seconds(config.latency)} + software "
                           f"{human_seconds(software)} per message")
    else:
        assert base is not None
        alpha, source[network] = base.alpha_across, f"from {config.tuning_file}"
    if config.link is not None:
        beta, source[network.replace("alpha", "beta")] = (1.0 / config.link,
                                                          f"--link {config.link * 8 / 1e9:g} Gbit/s")
        beta_pairwise = None  # a full-duplex link: two-way exchanges at the link rate too
    else:
        assert base is not None
        beta, source[network.replace("alpha", "beta")] = base.beta_across, f"from {config.tuning_file}"
        beta_pairwise = base.beta_pairwise_inter if base.two_level else base.beta_pairwise
    if config.gamma is not None:
        gamma, source["gamma"] = config.gamma, "--gamma"
    elif base is not None:
        gamma, source["gamma"] = base.gamma, f"from {config.tuning_file}"
    else:
        gamma = DEFAULT_GAMMA[config.dtype]
        source["gamma"] = f"default for {config.dtype}, measured on the reference machine"
    if base is not None:
        overhead, source["overhead"] = base.overhead, f"from {config.tuning_file}"
    else:
        overhead, source["overhead"] = DEFAULT_OVERHEAD, "default, measured on the reference machine"
    copy_alpha, copy_beta = staging_params(config, base, source)
    per_host = config.ranks_per_host
    if base is not None and base.two_level or per_host is not None and per_host > 1:
        # Within a host: --host-link and --host-latency, else the file's (its values within a
        # host where it has two levels, its only ones where it has one).
        host_alpha, host_beta = (base.alpha, base.beta) if base is not None else (0.0, 0.0)
        host_pairwise = base.beta_pairwise if base is not None else None
        if network == "alpha":  # a one-level file (or none): its network values go between hosts
            source["alpha_inter"], source["beta_inter"] = source["alpha"], source["beta"]
        source["alpha"] = source["beta"] = f"from {config.tuning_file}"
        if config.host_latency is not None:
            host_alpha = config.host_latency + software
            source["alpha"] = (f"--host-latency {human_seconds(config.host_latency)} + software "
                               f"{human_seconds(software)} per message")
        if config.host_link is not None:
            host_beta, host_pairwise = 1.0 / config.host_link, None
            source["beta"] = f"--host-link {config.host_link / 1e9:g} GB/s"
        return ModelParams(host_alpha, host_beta, gamma, overhead, host_pairwise,
                           ranks_per_host=per_host or base.ranks_per_host,  # type: ignore[union-attr]
                           alpha_inter=alpha, beta_inter=beta, beta_pairwise_inter=beta_pairwise,
                           copy_alpha=copy_alpha, copy_beta=copy_beta), source
    return ModelParams(alpha, beta, gamma, overhead, beta_pairwise, copy_alpha=copy_alpha,
                       copy_beta=copy_beta), source


def staging_params(config: PredictConfig, base: Any, source: dict[str, str]) -> tuple[float, float]:
    """(copy_alpha, copy_beta) for --staged: the flags, else the tuning file's; (0, 0) without
    --staged. PredictionInputError where --staged has neither."""
    if not config.staged:
        return 0.0, 0.0
    measured = base is not None and base.copy_beta > 0
    given = {"copy_alpha": config.copy_latency,
             "copy_beta": None if config.copy_bandwidth is None else 1.0 / config.copy_bandwidth}
    missing = [flag for flag, name in (("--copy-latency", "copy_alpha"),
                                       ("--copy-bandwidth", "copy_beta")) if given[name] is None]
    if missing and not measured:
        raise PredictionInputError(f"--staged needs {' and '.join(missing)} (or a --tuning-file measured "
                                   "with `hpcdl tune --device gpu`, which holds copy_alpha and copy_beta)")
    values = []
    for name, flag in (("copy_alpha", "--copy-latency"), ("copy_beta", "--copy-bandwidth")):
        value = given[name]
        if value is not None:
            values.append(float(value))
            source[name] = flag
        else:
            values.append(float(getattr(base, name)))
            source[name] = f"from {config.tuning_file}"
    return values[0], values[1]


def plan_step(params: Any, nodes: int, parameters: int, dtype: str, bucket_mb: float,
              compute_s: float, staged: bool = False
              ) -> tuple[Buckets, list[StepPrediction], dict[int, str]]:
    """The buckets, a `StepPrediction` per modelled allreduce algorithm plus auto's (last), and auto's pick
    per distinct bucket size (the model's fastest). Closed forms: at most two sizes are priced,
    whatever the number of buckets or ranks. `staged`: device buffers staged through host memory."""
    from collectives.cost.prediction import best, modelled_algorithms, predict

    itemsize = ITEMSIZE[dtype]
    buckets = Buckets.of(parameters, itemsize, bucket_mb)

    def seconds(algorithm: str, nbytes: int) -> float:
        return predict("allreduce", algorithm, nbytes, nodes, params, itemsize=itemsize,
                       staged=staged) if nbytes else 0.0

    plans = [StepPrediction(a, buckets, seconds(a, buckets.cap), seconds(a, buckets.rest), compute_s)
             for a in modelled_algorithms("allreduce")]
    picks = {b: best("allreduce", b, nodes, params, itemsize=itemsize, staged=staged)
             for b in buckets.sizes()}
    auto = StepPrediction("auto", buckets, seconds(picks.get(buckets.cap, "ring"), buckets.cap),
                seconds(picks.get(buckets.rest, "ring"), buckets.rest), compute_s)
    return buckets, [*plans, auto], picks


def _two_level_lines(params: Any, source: dict[str, str], tuning_file: str | None) -> list[str]:
    """--predict's lines for the parameters between hosts of a two-level model (none otherwise)."""
    if not params.two_level:
        return []
    lines = [f"  between hosts ({params.ranks_per_host} ranks per host; alpha and beta above are "
             "within a host):",
             f"  alpha_inter {params.alpha_across * 1e6:9.3f} µs per message ({source['alpha_inter']})",
             f"  beta_inter  {params.beta_across * 1e9:9.4f} ns per byte    ({source['beta_inter']}; "
             f"{1 / params.beta_across / 1e9 if params.beta_across else math.inf:.3g} GB/s)"]
    if params.beta_pairwise_inter is not None:
        lines.append(f"  beta_pairwise_inter {params.beta_pairwise_inter * 1e9:.4f} ns per byte of a "
                     f"two-way exchange (from {tuning_file})")
    return lines


def _staging_lines(params: Any, source: dict[str, str], buckets: Buckets, nodes: int) -> list[str]:
    """--predict --staged's lines: the copy parameters, and the staging piece the model picks for
    a ring step of the largest bucket."""
    from collectives.cost.prediction import staging_piece

    step = -(-buckets.sizes()[0] // nodes)  # a ring step's block
    piece = staging_piece(step, params)
    return [f"  copy_alpha {params.copy_alpha * 1e6:7.3f} µs per copy          ({source['copy_alpha']})",
            f"  copy_beta  {params.copy_beta * 1e9:7.4f} ns per byte copied  ({source['copy_beta']}; "
            f"{1 / params.copy_beta / 1e9 if params.copy_beta else math.inf:.3g} GB/s)",
            f"  staged: device buffers copied through pinned host memory, pipelined; a ring step "
            f"of {human_bytes(step)} in staging pieces of {human_bytes(piece)} (the model's pick)"]


def shared_cores(tuning_file: str | None) -> str | None:
    """A note where the tuning file was measured with more ranks on a host than it has cores
    (its `measured_on`), else None. There the ranks' copies, folds and training threads share
    the cores, the host's CPU can bound the step, and the model prices neither."""
    if not tuning_file:
        return None
    from collectives.select import load_table

    try:
        job = load_table(tuning_file)["model"]["measured_on"]
        ranks, cores = job["ranks_per_host"], job["cores_per_host"]
        crowded = {h: (int(n), int(cores[h])) for h, n in ranks.items()
                   if h in cores and int(cores[h]) > 0 and int(n) > int(cores[h])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # older files do not say how many cores their hosts had
    if not crowded:
        return None
    host, (n, c) = max(crowded.items(), key=lambda item: item[1][0] / item[1][1])
    return (f"note: {tuning_file} was measured with {n} ranks on {host}'s {c} cores. The model "
            "gives each rank a core: where ranks share cores, a step takes at least (ranks x CPU "
            "per rank per step) / cores, which it does not price (benchmarks/host_cpu.py measures "
            "that CPU; docs/cost_model.md, \"The host's CPU\").")


def auto_algorithm(tuning_file: str | None, params: Any, nbytes: int, nodes: int, itemsize: int) -> str:
    """What `auto` runs for an allreduce of `nbytes` on `nodes` ranks with HPCDL_TUNING_FILE set to
    `tuning_file` (collectives/select.py): the file's row covering the rank count, else the model's
    fastest. "mpi", which the model cannot price, counts as the model's fastest."""
    from collectives.cost.prediction import best
    from collectives.select import load_table, row_choice

    if tuning_file:
        chosen = row_choice(load_table(tuning_file).get("collectives", {}).get("allreduce", []), nbytes, nodes)
        if chosen is not None and chosen != "mpi":
            return chosen
    return best("allreduce", nbytes, nodes, params, itemsize=itemsize)


def replay(config: PredictConfig, params: Any, schedule: Any, compute_s: float) -> dict[str, Any]:
    """Every algorithm's (and auto's) step of `compute_s` with the timeline's buckets, overlap on
    and off (overlap.step_seconds)."""
    from collectives.cost.prediction import modelled_algorithms, predict

    from .overlap import step_seconds

    itemsize = ITEMSIZE[config.dtype]
    results: dict[str, Any] = {}
    for algorithm in [*modelled_algorithms("allreduce"), "auto"]:
        def call(nbytes: int, algorithm: str = algorithm) -> float:
            chosen = auto_algorithm(config.tuning_file, params, nbytes, config.nodes, itemsize) \
                if algorithm == "auto" else algorithm
            return predict("allreduce", chosen, nbytes, config.nodes, params, itemsize=itemsize,
                           staged=config.staged)
        on, communication = step_seconds(schedule, compute_s, call, overlap=True)
        off, _ = step_seconds(schedule, compute_s, call, overlap=False)
        on = off - config.overlap_efficiency * (off - on)  # the share of the overlap training gets
        results[algorithm] = {"communication_s": communication, "step_s": on, "step_no_overlap_s": off,
                              "efficiency": compute_s / on, "efficiency_no_overlap": compute_s / off}
    return results


def run_predict(config: PredictConfig) -> int:
    """Print the plan (and write `config.json`); 0. PredictionInputError for what cannot be
    planned with."""
    schedule = None
    if config.timeline:
        from .overlap import BucketSchedule

        try:
            schedule = BucketSchedule.from_timeline(config.timeline)
        except ValueError as exc:
            raise PredictionInputError(f"--timeline {exc}") from None
        if config.model_params is None:
            config = dataclasses.replace(config, model_params=schedule.total_bytes // ITEMSIZE[config.dtype])
    assert config.model_params is not None, "the command asks for --model-params without --timeline"
    params, source = predict_params(config)
    compute_s = config.compute_ms * 1e-3
    buckets, plans, picks = plan_step(params, config.nodes, config.model_params, config.dtype,
                                      config.bucket_mb, compute_s, config.staged)
    lines = [
        f"hpcdl tune --predict: {config.nodes} ranks, allreduce of {config.model_params:,} {config.dtype} "
        f"gradients ({human_bytes(buckets.total)}) per step in {buckets.count:,} bucket"
        f"{'s' if buckets.count != 1 else ''} of at most {human_bytes(buckets.sizes()[0])}, "
        f"compute {config.compute_ms:g} ms per step",
        f"  alpha    {params.alpha * 1e6:9.3f} µs per message      ({source['alpha']})",
        f"  beta     {params.beta * 1e9:9.4f} ns per byte         ({source['beta']}; "
        f"{1 / params.beta / 1e9 if params.beta else math.inf:.3g} GB/s)",
        *([f"  beta_pairwise {params.beta_pairwise * 1e9:.4f} ns per byte of a two-way "
           f"exchange (from {config.tuning_file})"] if params.beta_pairwise is not None else []),
        *_two_level_lines(params, source, config.tuning_file),
        f"  gamma    {params.gamma * 1e9:9.4f} ns per byte reduced ({source['gamma']})",
        f"  overhead {params.overhead * 1e6:9.3f} µs per call         ({source['overhead']})",
        *(_staging_lines(params, source, buckets, config.nodes) if config.staged else []),
        "",
        f"{'algorithm':<18} {'per bucket':>11} {'per step':>11} {'efficiency':>11} {'overlapped':>11}",
    ]
    for plan in plans:
        lines.append(f"{plan.algorithm:<18} {human_seconds(plan.first_s):>11} "
                     f"{human_seconds(plan.total_s):>11} {plan.efficiency_no_overlap:>10.1%} "
                     f"{plan.efficiency_overlap:>10.1%}")
    lines += [
        "",
        "per bucket: the first (largest) bucket's allreduce; per step: all buckets, one allreduce "
        "each, one after another.",
        "efficiency: compute / (compute + communication), no overlap.",
        "overlapped: perfect overlap of every bucket but the last: the earlier buckets' allreduces "
        "run during compute (as if their gradients were ready from the start of the step), the last "
        "starts when compute ends: compute / (max(compute, earlier buckets) + last bucket). An "
        "upper bound: backward is only part of the compute.",
        "auto would pick: " + "; ".join(
            f"{a} for {human_bytes(b)}" for b, a in picks.items())
        + " (the model's fastest; a tuning file's measured rows take precedence at their rank count)",
    ]
    replayed = None
    if schedule is not None:
        replayed = replay(config, params, schedule, compute_s)
        calls = sum(len(c) for c in schedule.calls)
        lines += [
            "",
            f"With the buckets of {config.timeline}: {len(schedule.calls)} buckets, {calls} allreduce calls, "
            f"{human_bytes(schedule.total_bytes)} per step; forward {schedule.forward_share:.0%} of the "
            f"compute, each bucket started when the timeline saw it ready during backward "
            f"(median of {schedule.steps - 1} steps):",
            f"{'algorithm':<18} {'per step':>11} {'step':>11} {'efficiency':>11} {'no overlap':>11} "
            f"{'efficiency':>11}",
        ]
        for algorithm, r in replayed.items():
            lines.append(f"{algorithm:<18} {human_seconds(r['communication_s']):>11} {human_seconds(r['step_s']):>11} "
                         f"{r['efficiency']:>10.1%} {human_seconds(r['step_no_overlap_s']):>11} "
                         f"{r['efficiency_no_overlap']:>10.1%}")
        lines += ["step: compute, with each bucket's allreduce calls run one after another on the "
                  "communication thread from the moment the bucket was ready (no overlap: all after "
                  "backward)" + (f", keeping {config.overlap_efficiency:.0%} of what that overlap saves "
                                 "(--overlap-efficiency)" if config.overlap_efficiency != 1 else "")
                  + "; efficiency: compute / step. auto follows --tuning-file's rows at this "
                  "rank count, else the model's fastest, as `auto` does at run time."]
    note = shared_cores(config.tuning_file)
    if note:
        lines += ["", note]
    print("\n".join(lines))
    if config.json:
        document = {"nodes": config.nodes, "compute_s": compute_s, "model_params": config.model_params,
                    "params": dataclasses.asdict(params),
                    "source": source, "uniform_buckets": {p.algorithm: {
                        "communication_s": p.total_s, "efficiency": p.efficiency_no_overlap,
                        "efficiency_overlap_bound": p.efficiency_overlap} for p in plans},
                    "timeline": config.timeline, "replay": replayed, "note": note}
        text = json.dumps(document, indent=1, default=str)
        try:  # whole or not at all: a full disk leaves no empty or partial file
            write_atomically(config.json, lambda f: f.write(text.encode()))
        except OSError as exc:
            print("hpcdl tune: error: " + write_failure("--json", config.json, exc, "the predictions",
                                                         "the table above holds them"), file=sys.stderr)
            return 1
    return 0
