"""Untrusted input in the app, driven headless with AppTest: a bad upload ends in the CLI's one-line message and
a tampered share link in warnings, never in a traceback; and no user-provided string (a config's `_name_or_path`,
a file name, a typed or linked model id) is ever rendered as Markdown, where an image would make the viewer's
browser fetch an outside URL."""

import json

import pytest
from markdown_it import MarkdownIt
from streamlit.testing.v1 import AppTest

from llmem.cli import main as cli_main
from llmem.options import OPTIONS
from llmem.ui.edits import app_words, group_of, widget_for
from llmem.view import plain

from .conftest import APP, ROOT

for _module in ("llmem.estimate", "llmem.compare", "llmem.units"):
    pytest.importorskip(_module, reason=f"{_module} has not landed yet; the app cannot render without it")

TIMEOUT = 120
UPLOAD = "Upload config.json"
EVIL = "![x](https://evil.example/p.png) <img src=https://evil.example/q.png> [y](https://evil.example/r)"
EVIL_FILE = "![n](https://evil.example/n.png)<img src=https://evil.example/m.png>.json"
# the element types whose text Streamlit renders as Markdown (alerts, headings, markdown, captions, toasts)
MARKDOWN_KINDS = ("title", "header", "subheader", "markdown", "caption", "success", "info", "warning", "error", "toast")
MD = MarkdownIt("commonmark").enable(["table", "strikethrough"])


def markdown_bodies(at: AppTest) -> list[str]:
    """The Markdown source of every element Streamlit renders as Markdown, main page and sidebar."""
    return [element.value for kind in MARKDOWN_KINDS for element in at.get(kind)]


def tokens(body: str) -> list:
    return [t for block in MD.parse(body) for t in [block, *(block.children or [])]]


def hazards(bodies: list[str]) -> list[str]:
    """Every image, raw HTML and link to the outside world these Markdown sources render to."""
    return [f"{t.type} in {body!r}" for body in bodies for t in tokens(body)
            if t.type in ("image", "html_inline", "html_block")
            or "evil.example" in str(t.attrGet("src") or t.attrGet("href") or "")]


def markdown_hazards(at: AppTest) -> list[str]:
    return hazards(markdown_bodies(at))


def shown_text(at: AppTest) -> str:
    """The text a viewer reads in the rendered Markdown elements (what the escaping must keep)."""
    return " ".join(t.content for body in markdown_bodies(at) for t in tokens(body) if t.type == "text")


def run(query: dict | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.query_params.update(query or {})
    return at.run()


def upload(at: AppTest, name: str, data: bytes) -> AppTest:
    return at.file_uploader(key="w_upload").set_value((name, data, "application/json")).run()


@pytest.fixture(scope="module")
def uploader() -> AppTest:
    """One session switched to "Upload config.json": each bad upload below costs a single script run. A link without
    a method: full fine-tuning, the command line's default, so the messages are the CLI's."""
    at = run({"model": "llama-3.1-8b"})
    return at.radio(key="w_source").set_value(UPLOAD).run()


def test_the_hazard_check_sees_an_image_a_tag_and_an_outside_link():
    """Unescaped, the strings used here are what the check must catch (so a pass below means something)."""
    found = " ".join(hazards([f"**{EVIL}** — config from uploaded {EVIL_FILE}", f"model: {EVIL!r}"]))
    assert "image" in found and "html_inline" in found and "link_open" in found
    assert not hazards([plain(EVIL), plain(EVIL_FILE)])


def test_a_config_name_and_file_name_with_markdown_render_as_plain_text():
    config = json.loads((ROOT / "presets" / "gpt2" / "config.json").read_text())
    at = run({"model": "gpt2"})
    at.radio(key="w_source").set_value(UPLOAD).run()
    upload(at, EVIL_FILE, json.dumps({**config, "_name_or_path": EVIL}).encode())
    assert not at.exception and not at.error
    assert not markdown_hazards(at)
    shown = shown_text(at)
    assert EVIL in shown and f"uploaded {EVIL_FILE}" in shown  # the name is shown, literally
    upload(at, EVIL_FILE, b"null")  # an error quoting the file name
    assert not at.exception and len(at.error) == 1
    assert not markdown_hazards(at)
    assert f"{EVIL_FILE}: expected a JSON object" in shown_text(at)


def test_a_typed_model_id_and_lora_targets_with_markdown_render_as_plain_text():
    at = run()
    at.radio(key="w_source").set_value("Hugging Face id").run()
    at.text_input(key="w_hub").set_value(EVIL)
    at.selectbox(key="w_method").set_value("lora").run()
    at.text_input(key="w_lora_targets").set_value(EVIL).run()
    assert not at.exception
    assert at.error and at.sidebar.error  # the model id in the page, the LoRA targets in the sidebar
    assert not markdown_hazards(at)
    assert "looks like a file path" in shown_text(at) and "is not a module name" in shown_text(at)


BAD_UPLOADS = {  # id: (file content, the field the message names)
    "json-nested-5000-deep": ('{"model_type": "llama", "x": ' + "[" * 5000 + "]" * 5000 + "}", "model"),
    "hidden-size-of-5000-digits": ('{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}", "model"),
    # dense layers among the expert ones named by something other than a list (qwen3_moe's are derived now)
    "qwen2-moe-dense-layers-not-a-list": (json.dumps({"model_type": "qwen2_moe", "mlp_only_layers": "x"}),
                                          "mlp_only_layers"),
    "bert": (json.dumps({"model_type": "bert"}), "model_type"),
    "llama4-text-without-heads": (json.dumps({"model_type": "llama4_text"}), "num_local_experts"),
    "unknown-model-type": (json.dumps({"model_type": "no-such-arch"}), "model_type"),
    "no-model-type": (json.dumps({"hidden_size": 8}), "model"),
    "zero-attention-heads": (json.dumps({"model_type": "llama", "num_attention_heads": 0}), "num_attention_heads"),
    "negative-hidden-size": (json.dumps({"model_type": "llama", "hidden_size": -4096}), "hidden_size"),
    "hidden-size-a-string": (json.dumps({"model_type": "llama", "hidden_size": "big"}), "hidden_size"),
    "json-list": ("[1, 2]", "model"),
    "json-number": ("42", "model"),
    "json-null": ("null", "model"),
    "not-utf8": (bytes(range(256)), "model"),
    "empty-file": ("", "model"),
    "over-the-size-cap": ('{"model_type": "llama", "pad": "' + "x" * 300_000 + '"}', "model"),
}


def cli_line(tmp_path, capsys, content: str | bytes, name: str) -> str:
    """What `llmem estimate --model <the file>` says on stderr, with the file's path shown as its bare name."""
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert cli_main(["estimate", "--model", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmem: error: ")
    return lines[0].removeprefix("llmem: error: ").replace(str(path), name)


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_a_bad_upload_shows_the_clis_one_line_message_naming_the_field(uploader, tmp_path, capsys, case):
    content, field = BAD_UPLOADS[case]
    expected = cli_line(tmp_path, capsys, content, "config.json")
    assert expected.startswith(f"{field}: ")
    at = upload(uploader, "config.json", content if isinstance(content, bytes) else content.encode())
    assert not at.exception, at.exception[0].message if at.exception else ""
    shown = plain(app_words(expected))  # the CLI's message, its --options named by their widgets, as plain text
    assert [e.value for e in at.error] == [shown]  # one inline message
    names = {o.key: o.name for o in OPTIONS if o.widget}
    title = "Model" if widget_for(field) == "w_source" else group_of(names[field])  # attn: Memory savers
    assert [e.value for e in next(e for e in at.sidebar.expander if e.label == title).error] == [shown]
    assert not at.success  # no verdict for this upload: the last valid one stays, greyed
    assert any(m.value.startswith("Last valid result") for m in at.markdown) and at.table
    assert at.number_input(key="w_gpus").value == 1  # the rest of the sidebar is still there


LINKS = [  # (query string, fields the warnings must name)
    ({"methods": "offload-params"}, []),  # 1 GPU: no row for it, as in the CLI, and no traceback
    ({"methods": "offload-params,lora,qlora", "gpus": "1", "zero": "0"}, []),
    ({"gpus": "0", "tp": "0", "zero": "9"}, ["gpus", "tp", "zero"]),
    ({"offload": "optimizer+params", "gpus": "1", "zero": "0"}, ["offload"]),
    ({"model": "gpt2", "gpus": "2", "tp": "2", "zero": "1"}, ["zero"]),
    ({"method": "qlora", "quant": "none", "precision": "fp32"}, ["quant"]),
    ({"optimizer": "adafactor", "optimizer-impl": "fused", "gpus": "8", "zero": "3"}, ["optimizer-impl", "optimizer"]),
    ({"model": EVIL, "gpus": EVIL, "lora-targets": EVIL, "upload": EVIL, EVIL: EVIL},
     ["model", "gpus", "lora-targets", "upload", "unknown link parameter"]),
]


@pytest.mark.parametrize("query, fields", LINKS, ids=[f"link{i}" for i in range(len(LINKS))])
def test_an_odd_or_tampered_share_link_opens_without_a_traceback(query, fields):
    at = run(query)
    assert not at.exception, at.exception[0].message if at.exception else ""
    assert not [e.value for e in at.error if not e.value.startswith("**Short by")]  # only an OOM verdict
    assert len([e for e in [*at.success, *at.error] if "Fits on" in e.value or "Short by" in e.value]) == 1
    warnings = " ".join(w.value for w in at.warning if w.value.startswith("Share link"))
    for field in fields:
        assert plain(field) in warnings, (field, warnings)
    assert bool(warnings) == bool(fields)
    assert not markdown_hazards(at)
