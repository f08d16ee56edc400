"""A LoRA chat fine-tune of an imported Llama from the command line (conversations tokenized with
the model's tokenizer folder and chat template, packed, the loss on the assistant's tokens), out
to the Hugging Face world: merged weights that transformers loads, peft adapters that peft loads
onto the base model, both with the run's own logits; generation on the run, and its chat reply
equal to transformers' on the merged export; its base checked by fingerprints.

Needs the reference extra (torch, transformers, peft), like tests/test_hf.py, and runs last in
its worker for the same reason (tests/conftest.py).
"""

import json
import shutil

import numpy as np
import pytest
from hf_reference import IDS, Reference, greedy_reference, libraries, reference_logits
from support import invoke

import theseus
from theseus.hf.importer import import_hf
from theseus.plot import read_metrics

LORA_RUN = [
    "finetune.lora_rank=8",
    "finetune.lora_alpha=16",
    "training.seq_len=63",
    "training.batch_size=16",
    "training.per_device_batch_size=4",
    "training.steps=3",
    "optimization.learning_rate=1e-2",
    "optimization.warmup_steps=1",
    "training.validation_interval=1",
    "training.validation_batches=1",
    "checkpointing.interval=3",
    "logging.progress_bar=false",
]
# A turn ends with "|", the end-of-turn token (the byte tokenizer's "|"), which trains.
CHAT = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '|\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
WORDS = ("red", "green", "blue", "cyan", "pink", "gold", "gray", "teal")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """An imported Llama (its tokenizer folder with a chat template), and a LoRA chat
    fine-tune initialised from it under tp=2 + FSDP, from the command line."""
    root = tmp_path_factory.mktemp("lora")
    reference = Reference("llama", root / "hf")
    config = {"eos_token": "|", "chat_template": CHAT}
    (reference.directory / "tokenizer_config.json").write_text(json.dumps(config))
    base = root / "base"
    import_hf(reference.directory, base)
    chats = root / "chats.jsonl"
    lines = [
        {
            "messages": [
                {"role": "user", "content": w},
                {"role": "assistant", "content": w},
            ]
        }
        for w in WORDS * 48
    ]
    chats.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tokenized = invoke("tokenize", chats, root / "tokens", "--tokenizer", reference.directory)
    assert tokenized.exit_code == 0, tokenized.output
    run = root / "run"
    result = invoke(
        "train", "--init-from", base, "--out", run, "--tp", 2, "--fsdp",
        f"data.path={root / 'tokens'}", *LORA_RUN,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return reference, base, run


def test_chat_fine_tune_lowers_the_loss_on_the_assistant_tokens(lora_run):
    _, _, run = lora_run
    rows = read_metrics(run)
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]
    record = json.loads((run / "run.json").read_text())
    packing = record["packing"]["data"]["train"]
    assert record["segmented_rows"] and packing["rows"] < packing["examples"]  # rows hold several
    assert all(0 < r["trained_tokens"] < 16 * 63 for r in rows)  # the assistant's tokens only


def test_merged_and_peft_exports_give_the_runs_logits(lora_run, tmp_path):
    """theseus.logits of the LoRA run (which trained away from the base) equals, within 1e-4,
    transformers on the merged export and peft's adapters on the base model; greedy generation
    on the run follows its own logits."""
    reference, _, run = lora_run
    logits = theseus.logits(run, IDS)
    assert np.abs(logits - reference.logits).max() > 1e-3  # the adapters changed the model

    lib = libraries()
    torch, transformers, peft = lib.torch, lib.transformers, lib.peft
    merged = invoke("export-hf", run, tmp_path / "merged")
    assert merged.exit_code == 0, merged.output
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32
    ).eval()
    np.testing.assert_allclose(reference_logits(model, IDS), logits, atol=1e-4, rtol=0)

    adapters = invoke("export-hf", run, tmp_path / "adapters", "--adapters")
    assert adapters.exit_code == 0, adapters.output
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16
    assert config["base_model_name_or_path"] == str(reference.directory.absolute())
    base = transformers.AutoModelForCausalLM.from_pretrained(
        reference.directory, dtype=torch.float32
    )
    with_adapters = peft.PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
    names = {n for n, _ in with_adapters.named_parameters() if "lora_A" in n}
    assert len(names) == 2 * 7  # 2 layers × q, k, v, o, gate, up, down
    np.testing.assert_allclose(reference_logits(with_adapters, IDS), logits, atol=1e-4, rtol=0)

    prompt = [int(i) for i in IDS[0, :5]]
    result = theseus.generate(
        run, [prompt], max_new_tokens=4, temperature=0.0, policy_changes={"tp": 2},
    )  # fmt: skip
    assert result.completions[0].token_ids == greedy_reference(model, prompt, 4)

    # A chat reply: transformers' (the same template, stopped at "|") equals theseus's.
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(reference.directory / "tokenizer.json"), eos_token="|"
    )
    messages = [{"role": "user", "content": "blue"}]
    ids = hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, chat_template=CHAT
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=hf.eos_token_id
        )
    want = out[0, len(ids) :].tolist()
    want = want[: want.index(hf.eos_token_id)] if hf.eos_token_id in want else want
    chat = invoke("generate", run, "--chat", "blue", "--temperature", 0, "--max-new-tokens", 8)
    assert chat.exit_code == 0, chat.output
    assert chat.stdout == hf.decode(want) + "\n"


def test_adapters_of_a_run_without_them_and_a_changed_base(lora_run, tmp_path):
    """--adapters on a run without adapters: exit 2, one paragraph. A base run replaced by
    other weights is refused when the LoRA run is read (its fingerprints)."""
    _, base, run = lora_run
    result = invoke("export-hf", base, tmp_path / "out", "--adapters")
    assert result.exit_code == 2 and "has no LoRA adapters" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()

    other = Reference("llama31", tmp_path / "hf")  # the same shapes, other weights
    saved = tmp_path / "saved-base"
    shutil.move(base, saved)
    try:
        import_hf(other.directory, base)
        with pytest.raises(ValueError, match="not those this run was trained on"):
            theseus.logits(run, IDS)
    finally:
        shutil.rmtree(base)
        shutil.move(saved, base)
