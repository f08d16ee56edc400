"""A LoRA chat fine-tune of an imported tiny Qwen3-MoE from the command line (adapters on every
projection: attention, routers and each expert's gate, up and down), under tp=2 + FSDP with the
experts over shard: its validation loss falls, and its merged export loads in transformers with
the run's logits. peft cannot load the expert adapters into transformers 5's fused experts, so
their peft export is refused. Needs the reference extra, like tests/test_moe_hf.py."""

import json

import numpy as np
from hf_reference import IDS, Reference, libraries, reference_logits
from support import invoke
from test_lora_hf import CHAT, CHAT_RUN, WORDS

import theseus
from theseus.hf.importer import import_hf
from theseus.plot import read_metrics


def test_lora_chat_fine_tune_of_qwen3_moe_exports_merged(tmp_path):
    reference = Reference("qwen3_moe", tmp_path / "hf")
    config = {"eos_token": "|", "chat_template": CHAT}
    (reference.directory / "tokenizer_config.json").write_text(json.dumps(config))
    import_hf(reference.directory, tmp_path / "base")
    chats = tmp_path / "chats.jsonl"
    turns = [[{"role": "user", "content": w}, {"role": "assistant", "content": w}] for w in WORDS]
    chats.write_text("".join(json.dumps({"messages": t}) + "\n" for t in turns * 48))
    tokens = invoke("tokenize", chats, tmp_path / "tokens", "--tokenizer", reference.directory)
    assert tokens.exit_code == 0, tokens.output
    run = tmp_path / "run"
    result = invoke(
        "train", "--init-from", tmp_path / "base", "--out", run, "--tp", 2, "--fsdp",
        "--experts", "shard", f"data.path={tmp_path / 'tokens'}", *CHAT_RUN,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = read_metrics(run)
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]
    assert all("aux_loss" in row and "expert_load" in row for row in rows)

    stored = "".join(p.read_text() for p in run.glob("checkpoints/*/state/array_metadatas/*"))
    for expert in ("gate_proj", "up_proj", "down_proj"):  # per-expert adapters were trained
        assert f"params.layers.mlp.{expert}.lora_a" in stored
    refused = invoke("export-hf", run, tmp_path / "adapters", "--adapters")
    assert refused.exit_code == 2 and "layers/mlp/gate_proj" in refused.output
    assert not (tmp_path / "adapters").exists()

    logits = theseus.logits(run, IDS)
    assert np.abs(logits - reference.logits).max() > 1e-3  # the adapters changed the model
    lib = libraries()
    merged = invoke("export-hf", run, tmp_path / "merged")
    assert merged.exit_code == 0, merged.output
    model = lib.transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=lib.torch.float32
    ).eval()
    np.testing.assert_allclose(reference_logits(model, IDS), logits, atol=1e-4, rtol=0)
