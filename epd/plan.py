"""`epd plan`: how many encoders, prefills and decoders a workload needs, from measurements.

Each role is sized on its own, as in the EPD paper's resource allocation: its load is the
workload's rate times the work one request brings it, its capacity per replica is measured on
the target hardware (a profile, see `Profile`), and each replica is kept at most `utilization`
busy so queues stay short. Then the targets:
- TPOT: decode runs the largest batch whose measured step time meets the TPOT target (step
  times between measured batch sizes are interpolated linearly, never extrapolated);
- TTFT: a request's encode and prefill times, each stretched by queueing at its role's
  utilization u (an M/M/1 queue: service / (1 - u)), must add up to at most the TTFT target;
  while they do not, the role where one more replica saves the most gets it (if the two
  take over 90% of the target with no queue at all, it says that no sensible replica count
  meets it: the queues would have to vanish).
Every role gets at least one replica: prefill reports itself unready without an encoder, and
text-only traffic costs an encoder nothing.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from epd.checkpoint.config import ProcessorConfig, load_processor_config
from epd.config.roles import Settings, option

ROLES = ("encode", "prefill", "decode")
HEADROOM = 0.9  # queueing must have room: service time at most this share of the TTFT target


@dataclass(frozen=True)
class Workload:
    rate: float  # requests per second
    prompt_tokens: int  # text tokens per request
    output_tokens: int
    images: float = 0.0  # images per request (on average)
    image_tokens: int = 0  # tokens one image becomes in the prompt
    ttft_s: float = 2.0
    tpot_s: float = 0.05

    @property
    def prefill_tokens(self) -> float:
        return self.prompt_tokens + self.images * self.image_tokens


@dataclass(frozen=True)
class Profile:
    """One replica of each role on the target hardware, measured (e.g. `scripts/bench_model.py
    --profile`): encode images/s (at the workload's image size), prefill tokens/s, and decode's
    step time by batch size."""

    images_per_s: float
    tokens_per_s: float
    step_s: dict[int, float]
    measured: str = ""

    @classmethod
    def read(cls, path: str | Path) -> Profile:
        raw = yaml.safe_load(Path(path).read_text())
        try:
            steps = {int(b): float(s) for b, s in raw["decode"]["step_s"].items()}
            profile = cls(
                float(raw["encode"]["images_per_s"]),
                float(raw["prefill"]["tokens_per_s"]),
                dict(sorted(steps.items())),
                str(raw.get("measured", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{path}: not a profile (see epd plan --help): {e}") from None
        values = [profile.images_per_s, profile.tokens_per_s, *steps, *steps.values()]
        if not steps or not all(math.isfinite(v) and v > 0 for v in values):
            raise ValueError(f"{path}: every rate, batch size and step time must be positive")
        return profile

    def step(self, batch: float) -> float:
        """Decode step time at `batch` (interpolated between measured sizes)."""
        sizes = list(self.step_s)
        if batch <= sizes[0]:
            return self.step_s[sizes[0]]
        for low, high in itertools.pairwise(sizes):
            if batch <= high:
                share = (batch - low) / (high - low)
                return self.step_s[low] + share * (self.step_s[high] - self.step_s[low])
        return math.inf  # not measured: not planned for


@dataclass
class Role:
    name: str
    load: float  # work per second: images (encode), tokens (prefill, decode)
    capacity: float  # the same work one replica does per second
    unit: str
    replicas: int = 1
    why: list[str] = field(default_factory=list)

    @property
    def busy(self) -> float:
        return self.load / (self.capacity * self.replicas)


@dataclass
class Plan:
    roles: dict[str, Role]
    ttft_s: float
    batch: int  # the largest batch that meets the TPOT target
    tpot_s: float  # at the batch the load makes
    problems: list[str]
    running: float = 1.0  # that batch

    @property
    def gpus(self) -> int:
        return sum(r.replicas for r in self.roles.values())

    @property
    def bottleneck(self) -> str:
        return max(self.roles.values(), key=lambda r: (r.replicas, r.busy)).name


def largest_batch(profile: Profile, tpot_s: float) -> int:
    """The largest measured-or-between batch whose step meets `tpot_s` (0 if none does)."""
    top = max(profile.step_s)
    return max((b for b in range(1, top + 1) if profile.step(b) <= tpot_s), default=0)


def queued(service_s: float, busy: float) -> float:
    return math.inf if busy >= 1 else service_s / (1 - busy)


def service_times(workload: Workload, profile: Profile) -> dict[str, float]:
    """Seconds one request spends being encoded and prefilled, with no queue."""
    return {
        "encode": workload.images / profile.images_per_s,
        "prefill": workload.prefill_tokens / profile.tokens_per_s,
    }


def ttft(roles: dict[str, Role], service: dict[str, float]) -> dict[str, float]:
    """Each role's share of a request's time to first token, queueing included."""
    return {name: queued(s, roles[name].busy) if s else 0.0 for name, s in service.items()}


def with_one_more(roles: dict[str, Role], service: dict[str, float], name: str) -> float:
    """TTFT if role `name` had one more replica."""
    roles[name].replicas += 1
    try:
        return sum(ttft(roles, service).values())
    finally:
        roles[name].replicas -= 1


def plan(workload: Workload, profile: Profile, utilization: float = 0.8) -> Plan:
    problems: list[str] = []
    batch = largest_batch(profile, workload.tpot_s)
    if batch == 0:
        problems.append(
            f"TPOT {workload.tpot_s * 1e3:g} ms is below one decode step at batch "
            f"{min(profile.step_s)} ({profile.step(1) * 1e3:.1f} ms): no replica count meets it"
        )
        batch = min(profile.step_s)
    roles = {
        "encode": Role("encode", workload.rate * workload.images, profile.images_per_s, "images"),
        "prefill": Role(
            "prefill", workload.rate * workload.prefill_tokens, profile.tokens_per_s, "tokens"
        ),
        "decode": Role(
            "decode",
            workload.rate * workload.output_tokens,
            batch / profile.step(batch),
            "tokens",
        ),
    }
    for role in roles.values():
        role.replicas = max(1, math.ceil(role.load / (role.capacity * utilization) - 1e-9))
        role.why.append(
            f"{role.load:.4g} {role.unit}/s to do, {role.capacity:.4g} per replica, "
            f"at most {utilization:.0%} busy: {role.replicas}"
        )
    roles["decode"].why.append(
        f"batches of up to {batch} sequences ({profile.step(batch) * 1e3:.1f} ms a step, "
        f"TPOT target {workload.tpot_s * 1e3:g} ms)"
    )
    service = sum(service_times(workload, profile).values())
    if service > HEADROOM * workload.ttft_s:  # near it, only endless replicas would do
        problems.append(
            f"TTFT {workload.ttft_s:g} s cannot be met: encoding and prefilling one request take "
            f"{service:.3g} s with no queue at all (over {HEADROOM:.0%} of the target)"
        )
    else:
        times = service_times(workload, profile)
        while (now := sum(ttft(roles, times).values())) > workload.ttft_s:
            best = min(times, key=lambda name: with_one_more(roles, times, name))
            roles[best].replicas += 1
            roles[best].why.append(f"+1 for TTFT: {now:.3g} s with one fewer")
    shares = ttft(roles, service_times(workload, profile))
    running = running_batch(workload, profile, roles["decode"].replicas, batch)
    return Plan(roles, sum(shares.values()), batch, profile.step(running), problems, running)


def running_batch(workload: Workload, profile: Profile, decoders: int, most: int) -> float:
    """The batch each decoder runs in the steady state: Little's law, b = λ · tokens · step(b)
    / decoders (a sequence stays for its tokens' steps), solved by iteration, at most `most`."""
    batch = 1.0
    for _ in range(200):
        batch = min(
            float(most),
            max(1.0, workload.rate * workload.output_tokens * profile.step(batch) / decoders),
        )
    return batch


def explain(result: Plan, workload: Workload, profile: Profile) -> str:
    lines = [
        f"workload: {workload.rate:g} requests/s, {workload.prompt_tokens} prompt + "
        f"{workload.images:g} × {workload.image_tokens} image tokens → "
        f"{workload.output_tokens} output tokens; TTFT ≤ {workload.ttft_s:g} s, "
        f"TPOT ≤ {workload.tpot_s * 1e3:g} ms",
        f"profile: {profile.measured or 'measured per replica'}",
        "",
    ]
    for role in result.roles.values():
        lines.append(f"{role.name}: {role.replicas} ({role.busy:.0%} busy)")
        lines += [f"  {why}" for why in role.why]
    lines += [
        "",
        f"predicted: TTFT {result.ttft_s:.3g} s (queueing included), TPOT "
        f"{result.tpot_s * 1e3:.1f} ms (decode batches of {result.running:.1f}; at most "
        f"{result.batch} meet the target)",
        f"{result.gpus} pods in all (a GPU each with the gpu overlay); the most go to "
        f"{result.bottleneck}, the bottleneck",
        *(f"problem: {p}" for p in result.problems),
    ]
    return "\n".join(lines)


def replicas_patch(result: Plan) -> str:
    """The overlay's replicas.yaml: one patch per workload."""
    kinds = {"encode": "StatefulSet", "prefill": "Deployment", "decode": "StatefulSet"}
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "apps/v1",
            "kind": kinds[name],
            "metadata": {"name": name},
            "spec": {"replicas": result.roles[name].replicas},
        }
        for name in ROLES
    ]
    head = "# Replicas per role, written by `epd plan` (edit by hand or run it again).\n"
    return head + yaml.safe_dump_all(docs, sort_keys=False)


@dataclass(frozen=True)
class PlanConfig(Settings):
    profile: str = option("", "measured per-replica rates, YAML (scripts/bench_model.py --profile)")
    rate: float = option(1.0, "requests per second to serve")
    prompt_tokens: int = option(256, "text tokens per prompt")
    output_tokens: int = option(256, "tokens generated per request")
    images: float = option(0.0, "images per request, on average")
    image_width: int = option(896, "image width in pixels")
    image_height: int = option(896, "image height in pixels")
    model: str = option(
        "", "checkpoint whose preprocessor_config.json counts image tokens (default: Kimi-VL's)"
    )
    ttft_s: float = option(2.0, "time to first token target")
    tpot_ms: float = option(50.0, "time per output token target")
    utilization: float = option(0.8, "most a replica may be busy, from 0 to 1")
    write: str = option(
        "",
        "write the replica counts here as a kustomize patch, e.g. "
        "deploy/kubernetes/overlays/gpu/replicas.yaml",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.profile:
            raise ValueError("profile is required: pass --profile FILE")
        if not 0 < self.utilization < 1:
            raise ValueError(f"utilization={self.utilization}: must be between 0 and 1")
        for name in ("rate", "prompt_tokens", "output_tokens", "tpot_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be positive")
        if self.images < 0:
            raise ValueError(f"images={self.images}: must not be negative")

    def workload(self) -> Workload:
        # Here, not at the top: the CLI's parser imports this module, and this pulls in torch.
        from epd.multimodal.image_processor import ImageProcessor

        if self.model:
            processor = ImageProcessor(load_processor_config(self.model))
        else:  # Kimi-VL's rules (mean and std do not change a count)
            processor = ImageProcessor(ProcessorConfig((0.5,) * 3, (0.5,) * 3))
        grid = processor.grid_for_size(self.image_width, self.image_height)
        return Workload(
            self.rate,
            self.prompt_tokens,
            self.output_tokens,
            self.images,
            processor.tokens(grid) if self.images else 0,
            self.ttft_s,
            self.tpot_ms / 1000,
        )


def main(config: PlanConfig) -> Plan:
    workload, profile = config.workload(), Profile.read(config.profile)
    result = plan(workload, profile, config.utilization)
    print(explain(result, workload, profile))
    if config.write:
        Path(config.write).write_text(replicas_patch(result))
        print(f"wrote {config.write}")
    return result
