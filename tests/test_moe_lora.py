"""A LoRA chat fine-tune of an imported tiny Qwen3-MoE from the command line (adapters on every
projection: attention, routers and each expert's gate, up and down), under tp=2 + FSDP with the
experts over shard: its validation loss falls, and its merged export loads in transformers with
the run's logits. peft cannot load the expert adapters into transformers 5's fused experts, so
their peft export is refused; a run adapting attention only exports peft's files, which peft
loads on the folder with the run's logits. Needs the reference extra, like
tests/test_moe_hf.py."""

import json

import numpy as np
import pytest
from hf_reference import IDS, Reference, libraries, reference_logits
from support import invoke
from test_lora_hf import CHAT, CHAT_RUN, WORDS

import theseus
from theseus.hf.importer import import_hf
from theseus.plot import read_metrics


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny Qwen3-MoE folder (its byte tokenizer with a chat template), its import and the
    chats tokenized."""
    root = tmp_path_factory.mktemp("moe_lora")
    reference = Reference("qwen3_moe", root / "hf")
    config = {"eos_token": "|", "chat_template": CHAT}
    (reference.directory / "tokenizer_config.json").write_text(json.dumps(config))
    import_hf(reference.directory, root / "base")
    chats = root / "chats.jsonl"
    turns = [[{"role": "user", "content": w}, {"role": "assistant", "content": w}] for w in WORDS]
    chats.write_text("".join(json.dumps({"messages": t}) + "\n" for t in turns * 48))
    tokens = invoke("tokenize", chats, root / "tokens", "--tokenizer", reference.directory)
    assert tokens.exit_code == 0, tokens.output
    return reference, root


def test_lora_chat_fine_tune_of_qwen3_moe_exports_merged(base, tmp_path):
    reference, root = base
    run = tmp_path / "run"
    result = invoke(
        "train", "--init-from", root / "base", "--out", run, "--tp", 2, "--fsdp",
        "--experts", "shard", f"data.path={root / 'tokens'}", *CHAT_RUN,
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


def test_attention_adapters_of_qwen3_moe_export_for_peft(base, tmp_path):
    """Adapters on q, k, v and o only (two steps, experts over shard): `export-hf --adapters`
    writes peft's files, and peft on the folder gives the run's logits within 1e-4."""
    reference, root = base
    run = tmp_path / "run"
    targets = "finetune.lora_targets=[q_proj,k_proj,v_proj,o_proj]"
    result = invoke(
        "train", "--init-from", root / "base", "--out", run, "--tp", 2, "--experts", "shard",
        f"data.path={root / 'tokens'}", *CHAT_RUN, "training.steps=2", targets,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    adapters = invoke("export-hf", run, tmp_path / "adapters", "--adapters")
    assert adapters.exit_code == 0, adapters.output
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    lib = libraries()
    on_base = lib.transformers.AutoModelForCausalLM.from_pretrained(
        reference.directory, dtype=lib.torch.float32
    )
    with_adapters = lib.peft.PeftModel.from_pretrained(on_base, tmp_path / "adapters").eval()
    assert sum("lora_A" in n for n, _ in with_adapters.named_parameters()) == 2 * 4
    logits = theseus.logits(run, IDS)
    assert np.abs(logits - reference.logits).max() > 1e-4  # the steps moved the model
    np.testing.assert_allclose(reference_logits(with_adapters, IDS), logits, atol=1e-4, rtol=0)
