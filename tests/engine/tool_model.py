"""A tiny Llama checkpoint that calls a tool: greedy decoding writes a known answer.

Built at test time, with nothing trained: the tokenizer (made with ``tokenizers``) is
byte-level BPE with no merges, so every byte is one token, plus ChatML's special tokens
and, as added tokens that are not special, the pieces of one answer. The model's layers
are all zeros (each adds nothing to the residual stream), its embeddings one-hot and its
``lm_head`` a table, so the next token is a fixed function of the current one: after the
``\\n`` that ends every ChatML prompt it writes::

    Let me check the weather.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call><|im_end|>

in :data:`PIECES`, tags split across tokens as a real model's are. Its template,
:data:`HERMES_TEMPLATE`, is Qwen 2.5's Hermes-style one: it renders ``tools`` in the
system prompt, an assistant's ``tool_calls`` as ``<tool_call>`` blocks and ``tool``
results as ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

__all__ = [
    "ANSWER_TEXT",
    "ARGUMENTS",
    "HERMES_TEMPLATE",
    "PIECES",
    "PREAMBLE",
    "TOOL_NAME",
    "write_tool_model",
]

TOOL_NAME = "get_weather"
ARGUMENTS = {"city": "Paris"}
PREAMBLE = "Let me check the weather."
PIECES = (
    PREAMBLE,
    "\n<tool_",
    "call>\n",
    '{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}',
    "\n</tool",
    "_call>",
)
ANSWER_TEXT = "".join(PIECES)  # what a request without tools gets back, as text
_SPECIAL = ("<|im_start|>", "<|im_end|>")

HERMES_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL])
    tokenizer.add_tokens([AddedToken(p, special=False, normalized=False) for p in PIECES])
    return tokenizer


def _token_id(tokenizer: Tokenizer, text: str) -> int:
    token_id = tokenizer.token_to_id(text)
    if token_id is None:
        raise LookupError(f"no token {text!r}")
    return int(token_id)


def write_tool_model(directory: Path) -> Path:
    """Write the checkpoint (see the module) into ``directory``; return it."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos = _token_id(tokenizer, "<|im_end|>")
    (newline,) = tokenizer.encode("\n").ids
    chain = [newline] + [_token_id(tokenizer, p) for p in PIECES]
    nexts = [eos] * vocab_size  # every other token ends the answer
    for current, following in zip(chain, [*chain[1:], eos], strict=True):
        nexts[current] = following
    hidden = -(-vocab_size // 16) * 16
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": eos,
    }
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    tokenizer_config = {"eos_token": "<|im_end|>", "add_bos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (directory / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    state = {
        "model.embed_tokens.weight": torch.eye(vocab_size, hidden),
        "model.norm.weight": torch.ones(hidden),
        # Column i is 10 at row NEXT[i]: the one-hot of token i scores its successor.
        "lm_head.weight": (
            10 * torch.eye(vocab_size)[nexts].T @ torch.eye(vocab_size, hidden)
        ).contiguous(),
        "model.layers.0.input_layernorm.weight": torch.ones(hidden),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(hidden),
    }
    for name, shape in {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden, hidden),
        "self_attn.v_proj": (hidden, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (16, hidden),
        "mlp.up_proj": (16, hidden),
        "mlp.down_proj": (hidden, 16),
    }.items():
        state[f"model.layers.0.{name}.weight"] = torch.zeros(shape)
    save_file(state, str(directory / "model.safetensors"))
    return directory
