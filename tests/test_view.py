"""`llmem.view.plain`: user text put into Markdown renders as that text, never as a link, image or HTML tag.

The Markdown parser here is markdown-it-py in CommonMark mode with GFM tables and strikethrough, the grammar
Streamlit's renderer follows; a string is safe when its tokens hold nothing but text."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from markdown_it import MarkdownIt

from llmem.view import plain

MD = MarkdownIt("commonmark").enable(["table", "strikethrough"])
ATTACKS = [
    "![x](https://evil.example/p.png)",
    "<img src=https://evil.example/q.png>",
    "model <img src=https://evil.example/i.png> inline",
    '<img src="https://evil.example/q.png" onerror="alert(1)">',
    "[click](javascript:alert(1))",
    "![x][ref]\n\n[ref]: https://evil.example/r.png",
    "<https://evil.example/auto.png>",
    "    indented code\n# heading\n- list\n> quote",
    "`code` **bold** _em_ ~~del~~ $x^2$ :red[colour] :material/home: &lt;b&gt; &#60;img&#62;",
    "| a | b |\n|---|---|\n| ![x](https://evil.example/t.png) | c |",
    "trailing backslash \\",
]


def inline_tokens(markdown: str) -> list:
    """Every token of the rendered Markdown, inline children included."""
    out = []
    for token in MD.parse(markdown):
        out.append(token)
        out.extend(token.children or [])
    return out


def assert_literal(text: str) -> None:
    tokens = inline_tokens(plain(text))
    kinds = {t.type for t in tokens}
    assert kinds <= {"paragraph_open", "paragraph_close", "inline", "text", "softbreak"}, (text, kinds)
    shown = "".join(t.content for t in tokens if t.type == "text")
    assert shown == " ".join(text.split()).replace("\0", "\ufffd"), (text, shown)  # CommonMark: NUL -> U+FFFD


def test_the_parser_used_here_does_see_images_and_tags_in_raw_text():
    """The oracle can fail: unescaped, these strings are images, HTML, links, code blocks, headings, emphasis."""
    kinds = {t.type for s in ATTACKS for t in inline_tokens(s)}
    assert {"image", "html_inline", "html_block", "code_block", "link_open", "heading_open", "em_open"} <= kinds


@pytest.mark.parametrize("text", ATTACKS)
def test_attacks_render_as_their_own_text(text):
    assert_literal(text)


@settings(max_examples=300, deadline=None)
@given(hs.text(alphabet=hs.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)
       | hs.text(alphabet="![]()<>`*_~$:\\&#;|-=+.!/\"' \nxa1", max_size=40))
def test_any_text_renders_as_itself(text):
    assert_literal(text)


def test_messages_stay_on_one_line_and_non_strings_are_accepted():
    assert "\n" not in plain("line one\nline two\r\nthree")
    assert plain(ValueError("hidden_size: got 'big'")) == "hidden\\_size\\: got \\'big\\'"
