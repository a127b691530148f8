"""BM25 search over a local corpus (the `bm25s` library), as two tools: `search(query)` and `open(doc_id)`.

Deterministic: the index depends only on the corpus; scores come from `bm25s` and ties are broken by corpus order.
`search` returns the top-k documents with a positive score (zero hits is a normal, ok result with
`signals["results"] == 0`); `open` returns a document's full text (`not_found` for an unknown id).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agentgrad.tools.base import FunctionTool, ToolErrorKind, ToolResult, tool

MAX_QUERY_CHARS = 500
STOPWORDS = "en"


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str


class Corpus(Sequence[Document]):
    """An ordered list of documents with unique ids."""

    def __init__(self, documents: Iterable[Document | Mapping[str, Any] | tuple[str, str, str]]) -> None:
        docs: list[Document] = []
        for d in documents:
            if isinstance(d, Document):
                docs.append(d)
            elif isinstance(d, Mapping):
                docs.append(Document(str(d["doc_id"]), str(d.get("title", "")), str(d["text"])))
            else:
                doc_id, title, text = d
                docs.append(Document(str(doc_id), str(title), str(text)))
        self._docs = docs
        self._by_id: dict[str, int] = {}
        for i, d in enumerate(docs):
            if d.doc_id in self._by_id:
                raise ValueError(f"duplicate doc_id {d.doc_id!r} in corpus")
            self._by_id[d.doc_id] = i

    @classmethod
    def from_jsonl(cls, path: str | Path) -> Corpus:
        """One JSON object per line with keys doc_id, title, text."""
        docs = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        docs.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
        return cls(docs)

    def get(self, doc_id: str) -> Document | None:
        i = self._by_id.get(doc_id)
        return None if i is None else self._docs[i]

    def __getitem__(self, i):  # type: ignore[override]
        return self._docs[i]

    def __len__(self) -> int:
        return len(self._docs)

    def __iter__(self) -> Iterator[Document]:
        return iter(self._docs)


def _tokenize(texts: list[str]) -> list[list[str]]:
    import bm25s

    tokens = bm25s.tokenize(texts, stopwords=STOPWORDS, return_ids=False, show_progress=False)
    return [[t for t in doc if t] for doc in tokens]


class BM25Index:
    """A `bm25s` index over a corpus (title + text). `search` returns [(index, score)] best first."""

    def __init__(self, corpus: Corpus) -> None:
        import bm25s

        self.corpus = corpus
        self._retriever = bm25s.BM25()
        tokens = _tokenize([f"{d.title}\n{d.text}" for d in corpus]) if len(corpus) else []
        self._empty = not any(tokens)  # bm25s cannot index a corpus without a single token
        if not self._empty:
            self._retriever.index(tokens, show_progress=False)

    def query_terms(self, query: str) -> list[str]:
        vocab = getattr(self._retriever, "vocab_dict", None) or {}
        return [t for t in _tokenize([query])[0] if t in vocab]

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        terms = [] if self._empty else self.query_terms(query)
        if not terms:
            return []
        scores = np.asarray(self._retriever.get_scores(terms), dtype=np.float64)
        order = np.argsort(-scores, kind="stable")  # ties: corpus order
        return [(int(i), float(scores[i])) for i in order[:k] if scores[i] > 0]


def _snippet(text: str, terms: list[str], chars: int) -> str:
    """About `chars` characters of `text` around the first occurrence of a query term, on word boundaries."""
    text = " ".join(text.split())
    if len(text) <= chars:
        return text
    start = 0
    lowered = text.lower()
    hits = [m.start() for t in terms for m in [re.search(r"\b" + re.escape(t), lowered)] if m]
    if hits:
        start = max(0, min(hits) - chars // 4)
        if start:
            space = text.find(" ", start)
            start = space + 1 if 0 <= space < min(hits) else start
    end = start + chars
    if end < len(text):
        space = text.rfind(" ", start, end)
        end = space if space > start + chars // 2 else end
    return ("..." if start else "") + text[start:end].strip() + ("..." if end < len(text) else "")


def make_search_tools(corpus: Corpus | Iterable[Document | Mapping[str, Any] | tuple[str, str, str]], *,
                      k: int = 3, snippet_chars: int = 200) -> list[FunctionTool]:
    """`search(query)` and `open(doc_id)` tools (category "search") over `corpus`."""
    if not isinstance(corpus, Corpus):
        corpus = Corpus(corpus)
    if k < 1:
        raise ValueError("k must be at least 1")
    index = BM25Index(corpus)

    def search(query: str) -> ToolResult:
        """Search the documents by keywords; returns the best matches with their ids.

        Args:
            query: keywords to look for
        """
        if not query.strip():
            return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, "query is empty")
        if len(query) > MAX_QUERY_CHARS:
            return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, f"query longer than {MAX_QUERY_CHARS} characters")
        hits = index.search(query, k)
        if not hits:
            return ToolResult(text=f"No results for {query!r}.", signals={"results": 0, "doc_ids": []})
        terms = index.query_terms(query)
        lines = []
        for rank, (i, _score) in enumerate(hits, 1):
            doc = corpus[i]
            lines.append(f"[{rank}] {doc.doc_id}: {doc.title}\n{_snippet(doc.text, terms, snippet_chars)}")
        return ToolResult(text="\n\n".join(lines),
                          signals={"results": len(hits), "doc_ids": [corpus[i].doc_id for i, _ in hits]})

    def open(doc_id: str) -> ToolResult:
        """Open a document by its id and return its full text.

        Args:
            doc_id: an id returned by search
        """
        doc = corpus.get(doc_id.strip())
        if doc is None:
            return ToolResult.error(ToolErrorKind.NOT_FOUND, f"no document with id {doc_id!r}", found=False)
        return ToolResult(text=f"{doc.title}\n\n{doc.text}" if doc.title else doc.text,
                          signals={"found": True, "doc_id": doc.doc_id, "chars": len(doc.text)})

    return [tool(search, name="search", category="search"), tool(open, name="open", category="search")]
