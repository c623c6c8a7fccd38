"""`epd plan` on a recorded profile, against answers worked out by hand (in the comments)."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from epd.plan import PlanConfig, Profile, Workload, largest_batch, plan, replicas_patch

ROOT = Path(__file__).parents[1]
PROFILE = Path(__file__).parent / "data" / "plan_profile.yaml"
# 4 requests/s of 1000 text tokens and one 896×896 image (64×64 patches → 1024 tokens),
# 200 tokens out.
WORKLOAD = Workload(4, 1000, 200, images=1, image_tokens=1024, ttft_s=2.0, tpot_s=0.042)


def replicas(result):
    return {name: role.replicas for name, role in result.roles.items()}


def test_the_image_tokens_come_from_kimi_vls_rules():
    workload = PlanConfig(profile=str(PROFILE), images=1, image_width=896).workload()
    assert workload.image_tokens == 1024 and workload.prefill_tokens == 256 + 1024


def test_each_role_is_sized_by_its_load():
    profile = Profile.read(PROFILE)
    # step(b) between 16 (20 ms) and 64 (50 ms) is 20 + (b - 16) × 30/48 ms ≤ 42 ms: b ≤ 51.2
    assert largest_batch(profile, 0.042) == 51
    result = plan(WORKLOAD, profile)
    # encode: 4 images/s over 10 per replica at ≤ 80%: 0.5 → 1 (40% busy)
    # prefill: 4 × 2024 = 8096 tokens/s over 10000 at ≤ 80%: 1.01 → 2
    # decode: 800 tokens/s over 51 / 41.875 ms = 1218 at ≤ 80%: 0.82 → 1
    assert replicas(result) == {"encode": 1, "prefill": 2, "decode": 1}
    # in the steady state b = 800 tokens/s × step(b): step(b) = 10 + (b - 1)/1.5 ms → b = 16
    assert result.batch == 51 and result.running == pytest.approx(16, abs=1e-3)
    assert result.tpot_s == pytest.approx(0.020, abs=1e-5)
    # TTFT: 0.1 s / (1 - 0.4) + 0.2024 s / (1 - 0.4048) = 0.1667 + 0.3401
    assert result.ttft_s == pytest.approx(0.50672, abs=1e-4)
    assert result.gpus == 4 and result.bottleneck == "prefill" and not result.problems


def test_a_tight_ttft_adds_replicas_where_they_save_most():
    workload = Workload(4, 1000, 200, images=1, image_tokens=1024, ttft_s=0.4, tpot_s=0.042)
    result = plan(workload, Profile.read(PROFILE))
    # from 0.5067 s: +1 prefill (0.4439), +1 encode (0.4022), +1 prefill (0.3788 ≤ 0.4)
    assert replicas(result) == {"encode": 2, "prefill": 4, "decode": 1}
    assert result.ttft_s == pytest.approx(0.37876, abs=1e-4)
    assert [w for w in result.roles["prefill"].why if w.startswith("+1")] == [
        "+1 for TTFT: 0.507 s with one fewer",
        "+1 for TTFT: 0.402 s with one fewer",
    ]


def test_targets_no_replica_count_meets_are_said():
    workload = Workload(4, 1000, 200, images=1, image_tokens=1024, ttft_s=0.25, tpot_s=0.005)
    result = plan(workload, Profile.read(PROFILE))
    assert len(result.problems) == 2
    assert "TPOT 5 ms is below one decode step" in result.problems[0]
    assert "0.302 s with no queue at all" in result.problems[1]  # 0.1 s encode + 0.2024 prefill
    # exactly at the target, queues would have to vanish: said, not looped on
    at_target = Workload(1, 256, 10, ttft_s=0.0256, tpot_s=0.05)
    assert "cannot be met" in plan(at_target, Profile.read(PROFILE)).problems[0]


def test_text_only_traffic_still_gets_an_encoder():
    result = plan(Workload(1, 100, 10, tpot_s=0.05), Profile.read(PROFILE))
    assert replicas(result) == {"encode": 1, "prefill": 1, "decode": 1}


def test_the_written_patch_matches_the_overlay(tmp_path):
    out = tmp_path / "replicas.yaml"
    command = [sys.executable, "-m", "epd.cli", "plan", "--profile", str(PROFILE)]
    flags = ["--rate", "4", "--prompt-tokens", "1000", "--output-tokens", "200", "--images", "1"]
    run = subprocess.run(
        [*command, *flags, "--tpot-ms", "42", "--write", str(out)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert "prefill: 2 (40% busy)" in run.stdout and "the most go to prefill" in run.stdout
    written = list(yaml.safe_load_all(out.read_text()))
    overlay = ROOT / "deploy" / "kubernetes" / "overlays" / "gpu" / "replicas.yaml"
    shipped = list(yaml.safe_load_all(overlay.read_text()))
    assert [(d["kind"], d["metadata"]["name"]) for d in written] == [
        (d["kind"], d["metadata"]["name"]) for d in shipped
    ]
    assert [d["spec"]["replicas"] for d in written] == [1, 2, 1]
    failing = subprocess.run([*command, *flags, "--tpot-ms", "5"], capture_output=True, text=True)
    assert failing.returncode == 1 and "problem: TPOT 5 ms" in failing.stdout


def test_a_bad_profile_is_named(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text(
        "encode: {images_per_s: 0}\nprefill: {tokens_per_s: 1}\ndecode: {step_s: {1: 1}}"
    )
    with pytest.raises(ValueError, match="must be positive"):
        Profile.read(bad)
    bad.write_text("encode: {}\n")
    with pytest.raises(ValueError, match="not a profile"):
        Profile.read(bad)
    assert replicas_patch(plan(WORKLOAD, Profile.read(PROFILE))).startswith("# Replicas")
