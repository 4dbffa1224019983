#!/usr/bin/env python3
"""Writes the chat-template parity fixture for trl-runtime's tokenizer tests.

Run by hand where transformers (and the trl wheel, for its templates) are installed; the Rust
tests only read the result:

    pip download --no-deps trl==1.16.0 && unzip -o trl-1.16.0-*.whl 'trl/chat_templates/*'
    python3 scripts/make_chat_template_fixture.py trl/chat_templates \
        trl-runtime/tests/fixtures/chat_templates

It copies every template TRL ships (`*.jinja`, Apache-2.0, from the trl wheel) to
<out>/templates/, writes a tokenizer directory <out>/tokenizer/ (the bundled tiny tokenizer with
every special-token slot a template reads), and <out>/expected.json: for each template and each
conversation below, what transformers' `apply_chat_template` gives on that tokenizer: the text,
the token ids, the assistant mask (templates with `{% generation %}`), or the error it raised.

`strftime_now` is pinned to SOURCE_DATE_EPOCH (written into the fixture) so the dates match.
"""
import datetime as _dt
import json
import shutil
import sys
from pathlib import Path

import transformers
import transformers.utils.chat_template_utils as ctu
from transformers import PreTrainedTokenizerFast

EPOCH = 1795392000  # 2026-11-23 00:00:00 UTC


class _FixedDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return _dt.datetime.fromtimestamp(EPOCH, tz=_dt.timezone.utc).replace(tzinfo=tz)


ctu.datetime = _FixedDatetime  # strftime_now reads datetime.now()

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

CONVERSATIONS = {
    "multi_turn_system": dict(
        messages=[
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3 + 5?"},
            {"role": "assistant", "content": "8"},
        ]
    ),
    "single_turn": dict(
        messages=[
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
        ]
    ),
    "generation_prompt": dict(
        messages=[
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hello!"},
        ],
        add_generation_prompt=True,
    ),
    "whitespace_unicode": dict(
        messages=[
            {"role": "user", "content": "  leading and trailing  \n\n\tтабы и 世界 🚀 <b>&amp;</b> \"quotes\" "},
            {"role": "assistant", "content": "\nline one\n  indented line\n\nlast line  "},
            {"role": "user", "content": "héllo"},
            {"role": "assistant", "content": "ça va ✓"},
        ]
    ),
    "tools": dict(
        messages=[
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": "Weather in Zürich?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}},
                    }
                ],
            },
            {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": "{\"temperature\": 3.5, \"sky\": \"cloudy\"}"},
            {"role": "assistant", "content": "It is 3.5 °C and cloudy in Zürich."},
        ],
        tools=[WEATHER_TOOL],
    ),
    "content_blocks": dict(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "text", "text": "a cat."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Small, furry, curious."}]},
        ]
    ),
    "reasoning": dict(
        messages=[
            {"role": "user", "content": "Is 91 prime?"},
            {"role": "assistant", "reasoning_content": "91 = 7 * 13.", "content": "No: 91 = 7 x 13."},
        ]
    ),
}


def main(src: Path, out: Path) -> None:
    templates = sorted(p for p in src.glob("*.jinja"))
    if out.exists():
        shutil.rmtree(out)
    (out / "templates").mkdir(parents=True)
    tok_dir = out / "tokenizer"
    tok_dir.mkdir()
    root = Path(__file__).resolve().parent.parent
    shutil.copy(root / "assets/tiny/model/tokenizer.json", tok_dir / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 1000000,
    }
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    expected = {
        "transformers": transformers.__version__,
        "source_date_epoch": EPOCH,
        "special_tokens_map": tok.special_tokens_map,
        "cases": [],
    }
    for path in templates:
        shutil.copy(path, out / "templates" / path.name)
        template = path.read_text()
        has_generation = "generation" in template and ctu.re.search(r"\{\%-?\s*generation\s*-?\%\}", template)
        for name, conv in CONVERSATIONS.items():
            kwargs = dict(
                tools=conv.get("tools"),
                chat_template=template,
                add_generation_prompt=conv.get("add_generation_prompt", False),
            )
            case = {"template": path.name, "conversation": name, **conv}
            try:
                text = tok.apply_chat_template(conv["messages"], tokenize=False, **kwargs)
            except Exception as e:  # the template refused this conversation
                case["error"] = f"{type(e).__name__}: {e}"
                expected["cases"].append(case)
                continue
            case["text"] = text
            case["input_ids"] = tok(text, add_special_tokens=False)["input_ids"]
            if has_generation:
                out_ = tok.apply_chat_template(
                    conv["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
                )
                assert out_["input_ids"] == case["input_ids"], path.name
                case["assistant_masks"] = out_["assistant_masks"]
            expected["cases"].append(case)
    (out / "expected.json").write_text(json.dumps(expected, ensure_ascii=False, indent=1) + "\n")
    n = len(expected["cases"])
    errors = sum("error" in c for c in expected["cases"])
    print(f"{len(templates)} templates, {n} cases ({errors} refused by the template) -> {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
