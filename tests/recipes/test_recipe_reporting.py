"""How the training recipes report, on the CPU (tiny SD3, a thread server, 2 groups of 4 images):
the progress line per iteration, ``--print-json``, ``--log-to tensorboard|wandb`` and ``--config``.

Every check reads back what was written (stdout, TensorBoard's event file, W&B's offline run file)
and compares it with the iteration's JSON record, the run's ground truth.
"""

from __future__ import annotations

import importlib
import io
import json
import re
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = ["--server", "thread", "--iterations", "2", "--prompts", "2", "--group-size", "4"]
# iter 2/3  reward -1.562 ± 0.0151  |ratio-1| 0  rollout 0.22s reward 0.00s train 0.15s push 0.02s  0.394 s/it  ETA 0s
LINE = re.compile(
    r"^iter (?P<it>\d+)/(?P<total>\d+)  reward (?P<mean>\S+) ± (?P<std>\S+)  (?P<label>.+?) (?P<dev>\S+)  "
    r"(?P<phases>rollout [\d.]+s reward [\d.]+s train [\d.]+s push [\d.]+s)  (?P<spi>[\d.]+) s/it  "
    r"ETA (?P<eta>\w+)$"
)


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module


# ---------------------------------------------------------------------------------------------- stdout
def test_flow_grpo_prints_one_progress_line_per_iteration(examples, capsys):
    run = examples("flow_grpo").main([*SMALL, "--iterations", "3"])
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if line.startswith("iter ")]
    assert len(lines) == 3, out
    assert not any(line.startswith('{"iteration"') for line in out)  # no per-iteration JSON by default
    for record, line in zip(run["history"], lines, strict=True):
        m = LINE.match(line)
        assert m, line
        assert int(m["it"]) == record["iteration"] + 1 and int(m["total"]) == 3
        assert float(m["mean"]) == pytest.approx(record["reward_mean"], rel=1e-3)
        assert float(m["std"]) == pytest.approx(record["reward_std"], rel=1e-3)
        assert m["label"] == "|ratio-1|" and m["dev"] == "0" and record["first_ratio_max_dev"] == 0.0
        assert float(m["spi"]) == pytest.approx(record["iteration_s"], rel=0.01)
    assert LINE.match(lines[-1])["eta"] == "0s"  # nothing left after the last iteration


def test_progress_line_formats_the_records_numbers(examples):
    report = examples("diffusion_rollout.recipes.report")
    record = {"iteration": 2, "reward_mean": -212.4111, "reward_std": 6.1871, "first_ratio_max_dev": 1.19e-7,
              "rollout_s": 7.051, "reward_s": 0.012, "train_s": 3.191, "push_s": 0.38, "iteration_s": 10.44}  # fmt: skip
    line = report.progress_line(record, 20, "first_ratio_max_dev", 9.8)
    assert line == (
        "iter 3/20  reward -212.41 ± 6.187  |ratio-1| 1.19e-07  "
        "rollout 7.05s reward 0.01s train 3.19s push 0.38s  10.4 s/it  ETA 2m47s"
    )
    assert report.duration(3725) == "1h02m" and report.duration(59.4) == "59s"
    # An iteration that recovered from a lost server says so, and with what cause.
    recovered = report.progress_line({**record, "recovered": ["rollout_connection_lost", "off_policy_batch"]},
                                     20, "first_ratio_max_dev", 9.8)  # fmt: skip
    assert recovered == line + "  recovered rollout_connection_lost,off_policy_batch"
    assert report.progress_line({**record, "recovered": []}, 20, "first_ratio_max_dev", 9.8) == line


def test_diffusion_nft_print_json_prints_the_records(examples, capsys):
    run = examples("diffusion_nft").main([*SMALL, "--print-json"])
    out = capsys.readouterr().out.splitlines()
    printed = [json.loads(line) for line in out if line.startswith('{"iteration"')]
    assert not any(line.startswith("iter ") for line in out)
    skip = ("rewards", "spans", "advantages", "rank_seconds")
    assert printed == [{k: v for k, v in h.items() if k not in skip} for h in run["history"]]


# ---------------------------------------------------------------------------------------------- --log-to
def test_tensorboard_gets_the_records_scalars_and_a_sample_grid(examples, tmp_path):
    pytest.importorskip("tensorboard")
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run.json"
    run = examples("flow_grpo").main([*SMALL, "--log-to", "tensorboard", "--out", str(out)])
    log_dir = tmp_path / "run-logs"  # the default: next to --out
    assert list(log_dir.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(log_dir), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    history = run["history"]
    for tag, key in (("reward/mean", "reward_mean"), ("reward/std", "reward_std"), ("train/loss", "loss"),
                     ("train/first_ratio_max_dev", "first_ratio_max_dev"), ("time/rollout_s", "rollout_s"),
                     ("throughput/images_per_second", "images_per_second")):  # fmt: skip
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [h["iteration"] for h in history], tag
        assert [v for _, v in got] == pytest.approx([h[key] for h in history], rel=1e-6), tag
    images = events.Images("samples")
    assert [e.step for e in images] == [0, 1]
    # Rank 0's 8 images of 32x32, 4 per row with 2-pixel gaps: 2 rows.
    assert (images[0].width, images[0].height) == (4 * 34 + 2, 2 * 34 + 2)
    grid = Image.open(io.BytesIO(images[0].encoded_image_string)).convert("RGB")
    first_tile = grid.crop((2, 2, 34, 34))
    assert first_tile.getextrema() != ((0, 0), (0, 0), (0, 0))  # an image, not the empty background


def _wandb_records(path: Path):
    """The records of a W&B run file: a 7-byte header, then LevelDB-style chunks in 32 KiB blocks
    (crc32, little-endian length, type: 1 full, 2 first, 3 middle, 4 last) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        size, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7 : pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            yield record
            buf = b""


def test_wandb_offline_run_gets_the_records_scalars_and_a_sample_grid(examples, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = examples("diffusion_nft").main([*SMALL, "--log-to", "wandb"])
    [run_dir] = (tmp_path / "wandb-home" / "wandb").glob("offline-run-*")
    [run_file] = run_dir.glob("run-*.wandb")
    rows = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in _wandb_records(run_file)
        if r.WhichOneof("record_type") == "history"
    ]
    history = run["history"]
    assert [row["_step"] for row in rows] == [h["iteration"] for h in history]
    for row, h in zip(rows, history, strict=True):
        assert row["reward/mean"] == pytest.approx(h["reward_mean"], rel=1e-12)
        assert row["train/old_policy_max_dev"] == 0.0 and row["train/loss"] == pytest.approx(h["loss"])
        assert row["train/checksum_ok"] == 1.0
        assert row["samples/_type"] == "image-file" and row["samples/width"] == 4 * 34 + 2
        assert (run_dir / "files" / row["samples/path"]).exists()
    config = next(r.run.config for r in _wandb_records(run_file) if r.WhichOneof("record_type") == "run")
    logged = {item.key: json.loads(item.value_json) for item in config.update}
    assert logged["recipe"] == "diffusion_nft" and logged["group_size"] == 4 and logged["log_to"] == ["wandb"]


def test_log_to_names_the_missing_package(examples, tmp_path, monkeypatch):
    logging_ = examples("diffusion_rollout.recipes.run_logger")
    monkeypatch.setitem(importlib.sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(SystemExit, match=r"--log-to wandb needs the wandb package \(pip install wandb\)"):
        logging_.RunLogger(["wandb"], tmp_path, recipe="flow_grpo", config={})


# ---------------------------------------------------------------------------------------------- --config
def test_config_sets_options_and_the_command_line_overrides_them(examples, tmp_path):
    flow_grpo = examples("flow_grpo")
    config = tmp_path / "run.yaml"
    config.write_text(
        "group_size: 4\n"  # a dest name
        "sde-window: 3\n"  # a long option's name
        "server-gpus: [0, 1]\n"  # an alias, a list for a comma-list option
        "lr: 1e-3\n"  # YAML reads this as a string: the option's own type converts it
        "kl_beta: 0.05\n"
        "cpu: true\n"
        "log_to: [tensorboard, wandb]\n"
        "url: null\n"  # null: the default
    )
    args = flow_grpo.parse_args(["--config", str(config), "--kl-beta", "0.2", "--log-to", "wandb"])
    assert args.group_size == 4 and args.sde_window == 3 and args.server_gpu == [0, 1]
    assert args.lr == 1e-3 and args.cpu is True and args.url is None
    assert args.kl_beta == 0.2  # the command line wins over the file
    assert args.log_to == ["wandb"]  # a list option is replaced, not extended
    assert args.prompts == 4 and args.config == str(config)  # others keep their defaults
    # Without --config the file does nothing; the other recipe reads the same file.
    assert flow_grpo.parse_args([]).group_size == 8
    nft = examples("diffusion_nft")
    nft_config = tmp_path / "nft.yaml"
    nft_config.write_text("group_size: 4\nema_decay: 0.9\n")
    nft_args = nft.parse_args(["--config", str(nft_config), "--ema-decay", "0.3"])
    assert nft_args.group_size == 4 and nft_args.ema_decay == 0.3


def test_a_reward_in_a_config_is_code_spelled_out_and_logged_once(examples, tmp_path, caplog):
    """``reward:`` names a callable the recipe imports and runs: only ``module:callable`` or
    ``file.py:callable`` is taken, and what was imported, from where, is logged once."""
    import logging

    flow_grpo, rewards = examples("flow_grpo"), examples("rewards")
    plugin = tmp_path / "my_scores.py"
    plugin.write_text(
        "def make(scale=1):\n    return lambda images, prompts: images.float().mean() * scale\n"
    )
    config = tmp_path / "run.yaml"
    config.write_text(f"reward: {plugin}:make?scale=2\n")
    args = flow_grpo.parse_args(["--config", str(config)])
    with caplog.at_level(logging.INFO, logger="diffusion_rollout.rewards"):
        rewards.load_reward(args.reward)
    [line] = [r.getMessage() for r in caplog.records if r.name == "diffusion_rollout.rewards"]
    assert line == (
        f"reward {args.reward!r}: imported {plugin}:make from {plugin} and called with {{'scale': 2}}; "
        "it runs in this process as this user (a reward spec is code)"
    )
    config.write_text("reward: popen\n")  # not a built-in, not module:callable: never guessed
    with pytest.raises(ValueError, match=r"reward 'popen': expected a built-in name .* or 'module:callable'"):
        rewards.load_reward(flow_grpo.parse_args(["--config", str(config)]).reward)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("group_sise: 4\n", r"unknown option 'group_sise' \(did you mean 'group_size'\?\)"),
        ("steps: four\n", r"'steps': argument --steps: invalid int value: 'four'"),
        ("cpu: 1\n", r"'cpu' is a flag: true or false"),
        ("step_kind: ode\n", r"'step_kind': argument --step-kind: invalid choice: 'ode'"),
        ("- group_size\n", r"expected a mapping of option names to values"),
    ],
)
def test_config_errors_name_the_key(examples, tmp_path, capsys, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        examples("flow_grpo").parse_args(["--config", str(config)])
    assert exit_info.value.code == 2
    assert re.search(f"--config {re.escape(str(config))}: {message}", capsys.readouterr().err)
