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
from pathlib import Path

import jax
import numpy as np
import pytest
from hf_reference import IDS, Reference, greedy_reference, libraries, reference_logits
from support import FAMILIES, invoke

import theseus
from theseus.config import apply_overrides, load_yaml
from theseus.hf.importer import IMPORTED_FROM, import_hf
from theseus.plot import read_metrics
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology
from theseus.training.run.loop import train
from theseus.training.run.mode import RunMode

LORA_RUN = [
    "finetune.lora_rank=8",
    "finetune.lora_alpha=16",
    "training.seq_len=16",
    "training.batch_size=16",
    "training.per_device_batch_size=4",
    "training.steps=3",
    "optimization.learning_rate=1e-2",
    "optimization.warmup_steps=1",
    "training.validation_interval=3",
    "training.validation_batches=1",
    "checkpointing.interval=3",
    "logging.progress_bar=false",
]
# The chat fine-tune: rows of 64 tokens hold two conversations; validation after every step.
CHAT_RUN = [
    *(o for o in LORA_RUN if not o.startswith(("training.seq_len", "training.validation_int"))),
    "training.seq_len=63",
    "training.validation_interval=1",
]
# A turn ends with "|", the end-of-turn token (the byte tokenizer's "|"), which trains.
CHAT = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '|\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
WORDS = ("red", "green", "blue", "cyan", "pink", "gold", "gray", "teal")


def peft_logits(reference: Reference, adapters: Path) -> np.ndarray:
    """transformers' float32 logits of IDS from the reference model with peft's adapters from
    ``adapters``, which must adapt every targeted projection of its 2 layers."""
    lib = libraries()
    base = lib.transformers.AutoModelForCausalLM.from_pretrained(
        reference.directory, dtype=lib.torch.float32
    )
    with_adapters = lib.peft.PeftModel.from_pretrained(base, adapters).eval()
    names = {n for n, _ in with_adapters.named_parameters() if "lora_A" in n}
    assert len(names) == 2 * 7  # 2 layers × q, k, v, o, gate, up, down
    return reference_logits(with_adapters, IDS)


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
    turns = [[{"role": "user", "content": w}, {"role": "assistant", "content": w}] for w in WORDS]
    chats.write_text("".join(json.dumps({"messages": t}) + "\n" for t in turns * 48))
    tokenized = invoke("tokenize", chats, root / "tokens", "--tokenizer", reference.directory)
    assert tokenized.exit_code == 0, tokenized.output
    run = root / "run"
    result = invoke(
        "train", "--init-from", base, "--out", run, "--tp", 2, "--fsdp",
        f"data.path={root / 'tokens'}", *CHAT_RUN,
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
    torch, transformers = lib.torch, lib.transformers
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
    got = peft_logits(reference, tmp_path / "adapters")
    np.testing.assert_allclose(got, logits, atol=1e-4, rtol=0)

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


# One LoRA step from the imported model: no warmup (its first step's learning rate would be 0),
# short rows, one device.
ONE_STEP = [
    "training.steps=1", "optimization.warmup_steps=0", "training.seq_len=8",
    "training.batch_size=8", "training.per_device_batch_size=8", "checkpointing.interval=1",
    "training.validation_interval=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def one_step_runs(tmp_path_factory):
    """``get(kind, family)``: an imported ``kind`` reference and one LoRA step on it (one
    device), made once: (reference, the run's folder)."""
    cache: dict[str, tuple[Reference, Path]] = {}

    def get(kind: str, family: str) -> tuple[Reference, Path]:
        if kind not in cache:
            root = tmp_path_factory.mktemp(f"lora-{kind}")
            reference = Reference(kind, root / "hf")
            import_hf(reference.directory, root / "base")
            trainer_class = FAMILIES[family].trainer_class
            model = load_yaml(trainer_class.config_class, root / "base" / "config.yaml").model
            overrides = [*LORA_RUN, *ONE_STEP]
            config = apply_overrides(trainer_class.config_class(model=model), overrides)
            one_device = Topology.new(ShardingPolicy(), jax.devices()[:1])
            train(trainer_class(config, ShardingPolicy(), one_device), root / "run",
                  mode=RunMode(init_from=root / "base"))  # fmt: skip
            cache[kind] = (reference, root / "run")
        return cache[kind]

    return get


@pytest.mark.parametrize(("kind", "family"), [("olmo2", "olmo2"), ("gemma3", "gemma")])
def test_lora_exports_of_other_families_load_in_transformers_and_peft(
    kind, family, one_step_runs, tmp_path
):
    """Each family's merged export and peft target names: one LoRA step from an imported model
    (`--init-from`, one device) exports merged weights transformers loads and adapters that peft
    puts on every targeted projection, both with the run's logits within 1e-4; `evaluate` gives
    the validation loss the run recorded."""
    reference, run = one_step_runs(kind, family)
    logits = theseus.logits(run, IDS, devices=jax.devices()[:1])
    assert np.abs(logits - reference.logits).max() > 1e-3  # the adapters changed the model
    lib = libraries()
    merged = invoke("export-hf", run, tmp_path / "merged")
    assert merged.exit_code == 0, merged.output
    model = lib.transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=lib.torch.float32
    ).eval()
    np.testing.assert_allclose(reference_logits(model, IDS), logits, atol=1e-4, rtol=0)
    result = invoke("export-hf", run, tmp_path / "adapters", "--adapters")
    assert result.exit_code == 0, result.output
    got = peft_logits(reference, tmp_path / "adapters")
    np.testing.assert_allclose(got, logits, atol=1e-4, rtol=0)
    # evaluate: the run's job and adapters from its folder, the validation loss it recorded.
    recorded = read_metrics(run)[-1]["val_loss"]
    assert theseus.evaluate(run).val_loss == pytest.approx(recorded, rel=1e-5)


def test_adapters_on_a_base_of_another_model_type_are_refused(one_step_runs, tmp_path):
    """A base imported as another model type than theseus writes (a gemma3 folder's language
    model exports as gemma3_text, whose modules peft names otherwise): --adapters is refused,
    exit 2, nothing written."""
    _, run = one_step_runs("gemma3", "gemma")
    base_record = run.parent / "base" / "run.json"
    record = json.loads(base_record.read_text())
    saved = dict(record[IMPORTED_FROM])
    record[IMPORTED_FROM]["model_type"] = "gemma3"
    base_record.write_text(json.dumps(record))
    try:
        result = invoke("export-hf", run, tmp_path / "refused", "--adapters")
    finally:
        base_record.write_text(json.dumps(record | {IMPORTED_FROM: saved}))
    assert result.exit_code == 2 and "imported as gemma3" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "refused").exists()
