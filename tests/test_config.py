import pytest

from hetjax.config import Config, ConfigError, all_keys, load_config, parse_bytes
from hetjax.launch import main, parse_args

STABLE_KEYS = [
    "train.steps",
    "train.batch_size",
    "train.seq_len",
    "train.grad_accum",
    "train.seed",
    "optimizer.name",
    "optimizer.lr",
    "optimizer.weight_decay",
    "optimizer.b1",
    "optimizer.b2",
    "optimizer.eps",
    "optimizer.grad_clip",
    "optimizer.warmup_steps",
    "optimizer.schedule",
    "offload.mode",
    "data.path",
    "data.shuffle",
    "model.num_layers",
    "model.d_model",
    "model.num_heads",
    "model.d_ff",
    "model.vocab_size",
    "model.max_seq_len",
    "model.compute_dtype",
]


def test_stable_key_names_exist():
    assert set(STABLE_KEYS) <= set(all_keys())


def test_overrides_are_parsed_into_field_types():
    c = Config().override(
        {
            "train.steps": "50",
            "optimizer.lr": "3e-4",
            "data.shuffle": "false",
            "model.compute_dtype": "bfloat16",
            "train.batch_size": "1_024",
        }
    )
    assert c.train.steps == 50 and isinstance(c.train.steps, int)
    assert c.optimizer.lr == pytest.approx(3e-4)
    assert c.data.shuffle is False and Config().data.shuffle is True  # shuffled by default
    assert c.model.compute_dtype == "bfloat16"
    assert c.train.batch_size == 1024
    assert Config().train.steps != 50  # the default is untouched (frozen)


def test_unknown_key_names_key_and_closest_valid_names():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.step'.*'train.steps'"):
        Config().override({"train.step": "5"})
    with pytest.raises(ConfigError, match=r"'optimizer.lr'"):
        Config().override({"train.lr": "0.1"})  # right name, wrong section
    with pytest.raises(ConfigError, match=r"unknown config key 'modle'"):
        Config().replace(modle=dict(num_layers=2))


@pytest.mark.parametrize(
    "key,value,pattern",
    [
        ("train.steps", "ten", r"'train.steps' must be an integer, got 'ten'"),
        ("train.steps", "0", r"'train.steps' must be >= 1, got 0"),
        ("optimizer.lr", "fast", r"'optimizer.lr' must be a number"),
        ("optimizer.schedule", "cosin", r"'optimizer.schedule' must be one of.*'cosine'"),
        ("data.shuffle", "maybe", r"'data.shuffle' must be true or false"),
        ("model.compute_dtype", "fp8", r"'model.compute_dtype' must be one of"),
        ("optimizer.b2", "1.5", r"'optimizer.b2' must be in \[0, 1\)"),
        ("memory.page_size", "4 MiBs", r"memory.page_size: cannot read"),
        ("offload.keep_level", "matmul", r"'offload.keep_level' must be one of.*'matmuls'"),
    ],
)
def test_bad_values_name_the_key(key, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        Config().override({key: value})


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="'model.d_model'.*divisible.*'model.num_heads'"):
        Config().override({"model.num_heads": "3"})
    with pytest.raises(ConfigError, match="'train.batch_size'.*'train.grad_accum'"):
        Config().override({"train.batch_size": "6", "train.grad_accum": "4"})
    with pytest.raises(ConfigError, match="'train.seq_len'.*'model.max_seq_len'"):
        Config().override({"train.seq_len": "1024"})


def test_nvme_boundaries_need_the_streaming_runtime():
    nvme = {"offload.activations": "nvme"}
    assert Config().override({**nvme, "offload.mode": "stream"}).offload.activations == "nvme"
    for mode in ("none", "auto"):
        with pytest.raises(
            ConfigError, match=r"'offload.activations' is 'nvme'.*offload.mode=stream"
        ):
            Config().override({**nvme, "offload.mode": mode})
    # and with data parallelism (tests/test_zero.py trains with it)
    dp = Config().override({**nvme, "offload.mode": "stream", "distributed.data_parallel": "2"})
    assert dp.offload.activations == "nvme"


def test_keep_level_needs_kept_blocks():
    stream = {"offload.mode": "stream", "offload.keep_level": "matmuls"}
    assert Config().override({**stream, "offload.keep_blocks": "2"}).offload.keep_level == "matmuls"
    with pytest.raises(ConfigError, match=r"'offload.keep_level' is 'matmuls'.*keep_blocks is 0"):
        Config().override(stream)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"offload.batch_chunks": "0"}, r"'offload.batch_chunks' must be >= 1"),
        ({"offload.mode": "none"}, r"'offload.batch_chunks' \(2\).*offload.mode is 'none'"),
        ({"offload.mode": "auto"}, r"'offload.batch_chunks' \(2\).*planner chooses it"),
        ({"offload.keep_blocks": "1"}, r"'offload.batch_chunks' \(2\).*offload.keep_blocks is 1"),
        ({"offload.swap_blocks": "1"}, r"'offload.batch_chunks' \(2\).*offload.swap_blocks is 1"),
        (
            {"train.batch_size": "6", "train.grad_accum": "2"},
            r"'offload.batch_chunks' \(2\) must divide.*\(3: train",
        ),
        (
            {"distributed.data_parallel": "4", "train.batch_size": "4"},
            r"'offload.batch_chunks' \(2\) must divide a device's rows.*\(1: .* / 4 devices",
        ),
        (
            {"model.family": "llama", "model.num_experts": "4"},
            r"'offload.batch_chunks' \(2\).*a mixture of experts",
        ),
        (
            {"model.family": "t5", "data.objective": "prefix_lm"},
            r"'offload.batch_chunks' \(2\).*an encoder-decoder",
        ),
    ],
)
def test_batch_chunks_errors(overrides, message):
    base = {"offload.mode": "stream", "offload.batch_chunks": "2", "train.batch_size": "8",
            "train.grad_accum": "1"}  # fmt: skip
    assert Config().override(base).offload.batch_chunks == 2
    with pytest.raises(ConfigError, match=message):
        Config().override({**base, **overrides})


def test_parse_bytes():
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(4096) == 4096
    assert parse_bytes("2gib") == 2 * 2**30
    assert Config().override({"memory.page_size": "8MiB"}).memory.page_size == 8 * 2**20


def test_config_file_resolution():
    by_path = load_config("configs/gpt175b.py")
    assert by_path == load_config("gpt175b.py") == load_config("gpt175b")
    assert by_path.model.num_layers == 96 and by_path.model.d_model == 12288
    with pytest.raises(ConfigError, match="gpt175b"):
        load_config("gpt175")


def test_command_line_overrides_both_forms():
    args, overrides = parse_args(
        ["--config", "gpt_tiny.py", "--config.train.steps=7", "--config.optimizer.lr", "0.5"]
    )
    assert args.config == "gpt_tiny.py"
    assert overrides == {"train.steps": "7", "optimizer.lr": "0.5"}


def test_launch_reports_config_errors(capsys):
    assert main(["--config.train.stepz=3"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'train.stepz'" in err and "train.steps" in err
    assert main(["--config", "gpt_tiny", "--config.train.steps=-1"]) == 2
    assert "'train.steps' must be >= 1" in capsys.readouterr().err
    assert main(["--config", "gpt175b.py", "--print-config"]) == 0
    assert "model.num_layers = 96" in capsys.readouterr().out
