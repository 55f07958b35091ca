"""The round trip of docs/guide/models.md, run as written there (paths moved under a
temporary directory): a tiny random Llama made locally with transformers is imported,
fine-tuned on jsonl records with the blocks streamed and its state on NVMe, generated
from, evaluated and exported; transformers loads the export and generates the tokens
hetjax generate printed."""

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from hf_models import build_hf_model

from hetjax import cli
from hetjax.instruct import Tokens

ROOT = Path(__file__).resolve().parent.parent


def guide_commands() -> list[str]:
    """The commands of the guide's "Fine-tune, generate, export" section."""
    text = (ROOT / "docs/guide/models.md").read_text()
    section = text.split("## Fine-tune, generate, export", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def _records(path: Path) -> None:
    rng = np.random.default_rng(0)
    colours = ["blue", "red", "green", "grey"]
    lines = []
    for _ in range(40):
        c = str(rng.choice(colours))
        lines.append(json.dumps({"prompt": f"Q: {c}? A:", "completion": f" {c} {c}."}))
    path.write_text("\n".join(lines) + "\n")


def _moved(arg: str, places: dict[str, str]) -> str:
    """An argument, or a ``--key=value``'s value, that is one of ``places`` -> its new path."""
    key, eq, value = arg.rpartition("=")
    return f"{key}={places.get(value, value)}" if eq else places.get(arg, arg)


# ~60 s on 2 busy cores: a streamed fine-tune, a streamed generation, eval and export
@pytest.mark.slow
def test_guide_round_trip(tmp_path, capsys):
    hf_dir = tmp_path / "llama-hf"
    original = build_hf_model("llama")
    original.save_pretrained(hf_dir)
    _records(tmp_path / "chat.jsonl")
    places = {
        "llama-hf": str(hf_dir), "chat.jsonl": str(tmp_path / "chat.jsonl"),
        "runs/ft": str(tmp_path / "ft"), "ft-hf": str(tmp_path / "ft-hf"),
        "/mnt/nvme/hetjax": str(tmp_path / "nvme"),
    }  # fmt: skip
    printed = {}
    for command in guide_commands():
        args = [_moved(a, places) for a in shlex.split(command)]
        assert args[0] == "hetjax", command
        capsys.readouterr()
        assert cli.main(args[1:]) == 0, command
        printed[args[1]] = capsys.readouterr().out
    # the export loads in transformers, fine-tuned (not the checkpoint it started from)
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ft-hf").float().eval()
    before = dict(original.named_parameters())
    changed = [n for n, p in tuned.named_parameters() if not torch.equal(p, before[n])]
    assert changed, "the export holds the imported params: nothing was fine-tuned"
    # transformers' greedy tokens from the export are those hetjax generate printed
    prompt = "Q: sky? A:"
    ids = torch.tensor([Tokens("").encode(prompt, special=True)])
    with torch.no_grad():
        out = tuned.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
            min_new_tokens=12, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    theirs = Tokens("").decode(out[0, ids.shape[1] :].tolist())
    assert printed["generate"] == prompt + theirs + "\n"
    loss = json.loads(printed["eval"].strip().splitlines()[-1])["loss"]
    assert 0 < loss < np.log(256)  # below a uniform guess over the bytes: it learned
