"""BM25 search tools over a small corpus: ranking, open(), not_found, empty queries, determinism."""

from __future__ import annotations

import json

import pytest

from agentgrad.tools.base import ToolErrorKind, ToolSet
from agentgrad.tools.search import Corpus, Document, make_search_tools
from agentgrad.types import ToolCall

DOCS = [
    ("paris", "Paris", "Paris is the capital and most populous city of France, on the river Seine."),
    ("berlin", "Berlin", "Berlin is the capital of Germany. The Berlin Wall divided the city until 1989."),
    ("seine", "Seine", "The Seine is a river in northern France. It flows through Paris into the English Channel."),
    ("python", "Python (programming language)",
     "Python is a high-level programming language. Its design emphasises code readability. " * 5),
    ("snake", "Pythonidae", "Pythons are nonvenomous snakes found in Africa, Asia and Australia."),
]


@pytest.fixture()
def tools():
    search, open_ = make_search_tools(DOCS, k=3, snippet_chars=80)
    return search, open_


def test_tool_schemas(tools):
    search, open_ = tools
    assert (search.name, search.category) == ("search", "search")
    assert (open_.name, open_.category) == ("open", "search")
    assert search.parameters["required"] == ["query"] and open_.parameters["required"] == ["doc_id"]


def test_ranking_sanity(tools):
    search, _ = tools
    r = search(query="capital of Germany")
    assert r.ok and r.signals["doc_ids"][0] == "berlin"
    r = search(query="river Seine France")
    assert set(r.signals["doc_ids"][:2]) == {"seine", "paris"}
    r = search(query="programming language readability")
    assert r.signals["doc_ids"][0] == "python"
    r = search(query="nonvenomous snakes")
    assert r.signals == {"results": 1, "doc_ids": ["snake"]}


def test_results_carry_ids_titles_and_snippets(tools):
    search, _ = tools
    r = search(query="Berlin Wall")
    assert r.text.startswith("[1] berlin: Berlin\n")
    assert "Berlin Wall" in r.text
    long = search(query="readability").text
    snippet = long.split("\n", 1)[1]
    assert len(snippet) <= 80 + 6 and snippet.endswith("...")  # capped, with an ellipsis


def test_top_k_and_result_count(tools):
    search, _ = tools
    r = search(query="the capital city river Paris Berlin Seine")
    assert r.signals["results"] == 3 == len(r.signals["doc_ids"])
    assert r.text.count("\n[") == 2


def test_zero_hits_is_ok(tools):
    search, _ = tools
    for q in ("zebra quantum", "the of and"):  # unknown words; only stopwords
        r = search(query=q)
        assert r.ok and r.signals["results"] == 0 and "No results" in r.text


def test_empty_query_is_bad_arguments(tools):
    search, _ = tools
    for q in ("", "   \n"):
        r = search(query=q)
        assert not r.ok and r.error_kind is ToolErrorKind.BAD_ARGUMENTS


def test_open_and_not_found(tools):
    _, open_ = tools
    r = open_(doc_id="seine")
    assert r.ok and r.text.startswith("Seine\n\n") and "English Channel" in r.text
    assert r.signals["found"] is True
    r = open_(doc_id="london")
    assert r.error_kind is ToolErrorKind.NOT_FOUND and r.signals["found"] is False


def test_deterministic_across_builds(tools):
    search, _ = tools
    again, _ = make_search_tools(list(reversed(list(reversed(DOCS)))), k=3, snippet_chars=80)
    for q in ("capital", "Paris river", "python", "city"):
        assert search(query=q).text == again(query=q).text == search(query=q).text


def test_ties_follow_corpus_order():
    docs = [(f"d{i}", "same", "identical words here") for i in range(5)]
    search, _ = make_search_tools(docs, k=5)
    assert search(query="identical").signals["doc_ids"] == ["d0", "d1", "d2", "d3", "d4"]


def test_corpus_from_jsonl_and_toolset(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps({"doc_id": d, "title": t, "text": x}) for d, t, x in DOCS) + "\n")
    corpus = Corpus.from_jsonl(path)
    assert len(corpus) == 5 and corpus.get("paris") == Document(*DOCS[0])
    ts = ToolSet(make_search_tools(corpus))
    assert ts.categories() == {"search": ["search", "open"]}
    assert ts.call(ToolCall("search", {"query": "Germany"})).signals["doc_ids"][0] == "berlin"
    assert ts.call(ToolCall("open", {"doc_id": 3})).error_kind is ToolErrorKind.BAD_ARGUMENTS


def test_duplicate_ids_are_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        Corpus([("a", "x", "y"), ("a", "z", "w")])


def test_empty_corpus():
    search, open_ = make_search_tools([])
    assert search(query="anything").signals["results"] == 0
    assert open_(doc_id="x").error_kind is ToolErrorKind.NOT_FOUND


def test_runner_search_and_bad_json(tmp_path):
    from agentgrad.tools.runner import run_tool

    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps({"doc_id": d, "title": t, "text": x}) for d, t, x in DOCS))
    out = run_tool("search", '{"query": "capital of Germany"}', corpus_path=str(path))
    assert out["ok"] and out["error_kind"] is None and out["signals"]["doc_ids"][0] == "berlin"
    assert json.loads(json.dumps(out)) == out
    assert run_tool("open", '{"doc_id": "nope"}', corpus_path=str(path))["error_kind"] == "not_found"
    assert run_tool("search", "{oops", corpus_path=str(path))["error_kind"] == "bad_arguments"
    assert run_tool("search", "[1, 2]", corpus_path=str(path))["error_kind"] == "bad_arguments"
    assert run_tool("search", '{"query": "x"}')["error_kind"] == "bad_arguments"  # no corpus
    assert run_tool("teleport", "{}")["error_kind"] == "not_found"
    assert run_tool("calculator", '{"expression": "6 * 7"}')["text"] == "42"


def test_corpus_without_any_token():
    search, open_ = make_search_tools([("a", "", "x y"), ("b", "", "")])  # single letters are not tokens
    assert search(query="x").signals["results"] == 0
    assert open_(doc_id="a").text == "x y"
