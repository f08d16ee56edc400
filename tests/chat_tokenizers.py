"""Tiny byte-level BPE tokenizer folders laid out as chat models' (no download): the chat
templates of Llama 3, Qwen2.5 (ChatML, a default system prompt, tools) and a ChatML template with
{% generation %} blocks, for tests/test_chat_data.py and tests/test_preference_data.py."""

import json
from pathlib import Path

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
GENERATION = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('role ' + message['role'] + ' is not one of this template') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] }}{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
CONVERSATIONS = [
    {
        "messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "  What is a naïve café? 😀 "},
            {"role": "assistant", "content": "A café without guile.\n"},
            {"role": "user", "content": "And a delta?"},
            {"role": "assistant", "content": "The fourth letter, after gamma."},
        ]
    },
    {  # "cafe\u0301" is not NFC: Qwen's normalizer changes it
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello, cafe\u0301 ça va"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Weather in Zürich and Bern?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]},
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "tool", "content": '{"temp": 19}'},
            {"role": "assistant", "content": "21 and 19 degrees."},
        ],
        "tools": TOOLS,
    },
]


# The pre-tokenizer pattern of Llama 3 and Qwen2.5 (Qwen2.5 splits digits one by one).
SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def make_tokenizer(name: str) -> Tokenizer:
    """A tiny byte-level BPE laid out as the named model's: Llama 3 (split, then bytes; a
    post-processor adding <|begin_of_text|>), Qwen2.5 (NFC first) or plain bytes."""
    tokenizer = Tokenizer(models.BPE())
    if name == "generation":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        split = pre_tokenizers.Split(Regex(SPLIT), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    if name == "qwen25":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
    )
    text = json.dumps(CONVERSATIONS, ensure_ascii=False) + QWEN25 + LLAMA3
    tokenizer.train_from_iterator([text] * 4, trainer)
    if name == "llama3":  # Llama 3's tokenizer adds <|begin_of_text|> to every text it encodes
        bos = ("<|begin_of_text|>", tokenizer.token_to_id("<|begin_of_text|>"))
        tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[bos]),
            ]
        )
    return tokenizer


def tokenizer_folders(root: Path) -> dict[str, Path]:
    """Tokenizer folders under ``root``: llama3 (template in tokenizer_config.json), qwen25
    (template in chat_template.jinja, as transformers 5 saves it) and generation."""
    made = {}
    for name, template, config in (
        ("llama3", LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
        ("qwen25", QWEN25, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
        (
            "generation",
            GENERATION,
            {"eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True}},
        ),
    ):
        folder = root / name
        folder.mkdir()
        make_tokenizer(name).save(str(folder / "tokenizer.json"))
        config = {**config, "tokenizer_class": "PreTrainedTokenizerFast"}
        if name == "qwen25":
            (folder / "chat_template.jinja").write_text(template)
        else:
            config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        made[name] = folder
    return made
