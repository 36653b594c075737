"""Every relative link in the user docs resolves: files, images and #anchors.

Reads README.md, input/README.md and tfpar/docs/*.md as text (no TensorFlow), so it runs in
well under a second.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "input" / "README.md", *sorted((ROOT / "tfpar" / "docs").glob("*.md"))]

# [text](target) and ![alt](target); the target ends at the first space or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a file's headings: lower case, punctuation dropped, spaces to -."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    found = set()
    for title in re.findall(r"^#{1,6} +(.+?) *$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def broken_links(doc: Path) -> list[str]:
    """The links of one file that point at no file or no heading, as 'file: target'."""
    text = FENCE.sub("", doc.read_text(encoding="utf-8"))
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto: - not checked offline
            continue
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.exists():
            bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            bad.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    return bad


def test_every_relative_link_in_the_docs_resolves():
    assert len(DOCS) > 3, DOCS
    bad = [line for doc in DOCS for line in broken_links(doc)]
    assert not bad, "\n".join(bad)


# A claim that cuDNN's RNN runs in 16 bits whatever the type: "cuDNN in 16 bits", "cuDNN in
# the 16-bit type", "its cuDNN op in 16 bits".
CUDNN_IN_16_BITS = re.compile(r"cuDNN[^.|]{0,40}?\bin (?:16 bits|the 16-bit type)", re.I)


def test_no_doc_claims_cudnn_computes_bfloat16_in_16_bits():
    """Issue 42, failure 5: TensorFlow's bfloat16 CudnnRNN kernel casts to float32 inside
    (tensorflow/tensorflow#60108), so mixed_bfloat16 is not 16-bit in cuDNN; the docs say
    so and recommend mixed_float16 for RNNs on GPUs."""
    sources = [*DOCS, ROOT / "tfpar" / "model" / "precision.py"]
    claims = [f"{path.relative_to(ROOT)}: {' '.join(m.group(0).split())}"
              for path in sources
              for m in CUDNN_IN_16_BITS.finditer(path.read_text(encoding="utf-8"))]
    assert claims == []
    for path in (ROOT / "README.md", ROOT / "tfpar" / "docs" / "strategies.md"):
        text = " ".join(path.read_text(encoding="utf-8").split())
        assert "bfloat16 cuDNN kernel casts to float32 inside" in text \
            or "bfloat16 kernel casts to float32 inside" in text, path.name
        assert "For RNNs on GPUs use `mixed_float16`" in text \
            or "For RNNs, `mixed_float16`" in text, path.name
