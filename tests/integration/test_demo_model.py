"""The shipped demo model (common/glm5/assets/glm5-tiny-addition): it is the default, it loads in our engine,
and it adds numbers it never saw in training (held-out pairs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from glm5.model.loader import load_model
from glm5.model.presets import SHIPPED_MODEL, default_model_path
from glm5_cli.demo import evaluate


def test_shipped_model_is_the_default_and_solves_held_out_additions() -> None:
    assert default_model_path() == SHIPPED_MODEL
    meta = json.loads((SHIPPED_MODEL / "training.json").read_text())
    assert sum(f.stat().st_size for f in SHIPPED_MODEL.iterdir()) <= 20 << 20  # ships in the repository
    accuracy = evaluate(SHIPPED_MODEL, meta["max_operand"], meta["held_out"], meta["seed"], limit=100)
    assert accuracy >= 0.95, accuracy  # 100% on all 500 held-out pairs: see docs/benchmarks.md (g)
    # its MTP layer (the drafter `glm5 worker` uses by default), fitted last and measured on held-out problems
    assert json.loads((SHIPPED_MODEL / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert len(load_model(SHIPPED_MODEL, mtp="require").mtp_layers) == 1
    assert meta["mtp"]["evaluation"]["addition"]["speculative"]["accepted_length"] >= 2.2  # k = 3


def test_demo_model_command_runs_both_stages(tmp_path: Path) -> None:
    """`glm5 demo-model` with tiny budgets: supervised stage, RL stage through `glm5 rl`, tool-use stage (with its
    drills), tool RL stage through `glm5 rl --env tools`, final model copied. The RL stages run small (one worker,
    two groups a step, 16 new tokens: an untrained model's answers run to the limit) through --rl-arg."""
    out = tmp_path / "model"
    small = ["--rl-arg=--workers=1", "--rl-arg=--trainer-arg=--groups-per-step=2",
             "--rl-arg=--trainer-arg=--max-inflight-groups=4",
             "--rl-arg=--trainer-arg=--max-new-tokens=16"]  # fmt: skip
    cmd = [sys.executable, "-m", "glm5_cli", "demo-model", "--out", str(out), "--steps", "30", "--stop-at", "20",
           "--batch", "8", "--rl-steps", "2", "--held-out", "16", "--tool-steps", "2",
           "--tool-sft-args", '{"drill_share": 0.5}', "--tool-rl-steps", "1", *small]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((out / "training.json").read_text())
    assert meta["sft"]["stopped_at"] == 20 and meta["rl"]["steps"] == 2 and meta["rl"]["final_version"] == 2
    assert 0.0 <= meta["rl"]["accuracy_before"] <= 1.0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        f.name for f in out.iterdir()
    }
    assert (tmp_path / "model.work" / "rl" / "rl.png").is_file()
    tools = meta["tools_sft"]
    assert tools["steps"] == 2 and tools["evaluation"]["problems"] == 16 and tools["index_topk"] == 1024
    assert tools["drill_share"] == 0.5
    tool_rl = meta["tools_rl"]
    assert tool_rl["steps"] == 1 and tool_rl["final_version"] == 1
    assert tool_rl["evaluation_after"]["problems"] == 16 and (tmp_path / "model.work" / "rl-tools" / "rl.png").is_file()
    assert json.loads((out / "config.json").read_text())["index_topk"] == 1024  # the tool stages' model was copied

    # more tool RL on the result (`--from` with RL only): recorded beside the first, the earlier stages kept
    again = tmp_path / "again"
    cmd = [sys.executable, "-m", "glm5_cli", "demo-model", "--from", str(out), "--out", str(again), "--held-out", "16",
           "--tool-rl-steps", "1", "--rl-seed", "1", *small]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    more = json.loads((again / "training.json").read_text())
    assert more["tools_rl"] == tool_rl and more["sft"] == meta["sft"] and more["tools_from"] == str(out)
    assert more["tools_rl_2"]["steps"] == 1 and more["tools_rl_2"]["seed"] == 1

    # an MTP layer fitted to that model last (`--mtp-steps`): recorded with its held-out acceptance, servable
    drafter = tmp_path / "drafter"
    cmd = [sys.executable, "-m", "glm5_cli", "demo-model", "--from", str(out), "--out", str(drafter),
           "--mtp-steps", "3", "--mtp-args", '{"traces_per_set": 4, "batch": 4}']  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mtp = json.loads((drafter / "training.json").read_text())["mtp"]
    assert mtp["steps"] == 3 and mtp["traces"] >= 10 and mtp["base"] == str(out)
    assert set(mtp["evaluation"]) == {"addition", "addition, thinking off", "tools"}
    assert all(e["speculative"]["num_speculative_tokens"] == 3 for e in mtp["evaluation"].values())
    assert len(load_model(drafter, mtp="require").mtp_layers) == 1
