"""search-qa: one-hop and two-hop questions over a generated corpus of fictional people, cities and companies.

Every few tasks share one generated *world* (a few cities, people and companies, one short document each), keyed
by (split, seed, chunk) and rebuilt deterministically from that key, so nothing can be memorised across worlds and
an env restored by replay sees the same corpus. Tools: `search(query)` (BM25, top-k with snippets) and
`open(doc_id)`. The expert searches each entity by name and opens its document only when the snippet does not
already show the fact it needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from agentgrad.envs.base import SUITES
from agentgrad.envs.tasks import LRUCache, NameMaker, TaskToolEnv, sample_in_split, stream_rng, verify_by_kind
from agentgrad.tools.base import ToolSet
from agentgrad.tools.search import Corpus, Document, make_search_tools
from agentgrad.types import Action, FinalAnswer, Task, ToolCall

SYSTEM_PROMPT = "Search the documents, open one if the snippet is not enough, then answer briefly."

JOBS = ("engineer", "painter", "chemist", "pilot", "architect", "teacher", "baker", "surgeon", "poet", "farmer")
PRODUCTS = ("valves", "lamps", "drones", "sensors", "bicycles", "cheese", "glassware", "robots", "textiles", "paper")
SUFFIXES = ("Industries", "Corp", "Labs", "Works", "Systems", "Group")


@dataclass(frozen=True)
class SearchQAOptions:
    cities: int = 5
    countries: int = 3
    people: int = 8
    companies: int = 6
    tasks_per_world: int = 4
    two_hop_fraction: float = 0.5
    k: int = 3  # search results per query
    snippet_chars: int = 100

    def __post_init__(self) -> None:
        if not (1 <= self.countries <= self.cities and self.companies >= 1 and self.people >= self.companies):
            raise ValueError(f"search-qa needs 1 <= countries <= cities, companies >= 1, people >= companies: {self}")
        if self.tasks_per_world < 1 or not 0.0 <= self.two_hop_fraction <= 1.0 or self.k < 1:
            raise ValueError(f"invalid search-qa options: {self}")


@dataclass(frozen=True)
class City:
    name: str
    country: str
    population: int
    doc_id: str


@dataclass(frozen=True)
class Person:
    name: str
    job: str
    birth_year: int
    city: str
    doc_id: str


@dataclass(frozen=True)
class Company:
    name: str
    product: str
    city: str
    employees: int
    founded: int
    founder: str
    doc_id: str


@dataclass
class SearchWorld:
    key: str
    cities: dict[str, City]
    people: dict[str, Person]
    companies: dict[str, Company]
    corpus: Corpus
    tools: ToolSet = field(repr=False)


def build_search_world(key: str, opts: SearchQAOptions, *, namespace: str = "search-world") -> SearchWorld:
    """The world of `key`: entities, their documents (in a shuffled order, ids d1..dN) and the search tools."""
    rng = stream_rng(namespace, "train", 0, key)
    names = NameMaker(rng)
    n_docs = opts.cities + opts.people + opts.companies
    ids = [f"d{i}" for i in range(1, n_docs + 1)]
    rng.shuffle(ids)
    countries = [names.word() for _ in range(opts.countries)]
    cities = {}
    for i in range(opts.cities):
        c = City(names.word(), countries[i % len(countries)] if i < len(countries) else rng.choice(countries),
                 rng.randint(1_000, 900_000), ids.pop())
        cities[c.name] = c
    city_names = list(cities)
    people = {}
    for _ in range(opts.people):
        p = Person(names.person(), rng.choice(JOBS), rng.randint(1900, 1960), rng.choice(city_names), ids.pop())
        people[p.name] = p
    founders = rng.sample(list(people), opts.companies)
    companies = {}
    for founder in founders:
        c = Company(f"{names.word()} {rng.choice(SUFFIXES)}", rng.choice(PRODUCTS), rng.choice(city_names),
                    rng.randint(20, 5_000), rng.randint(1985, 2020), founder, ids.pop())
        companies[c.name] = c
    docs = []
    for c in cities.values():
        docs.append(Document(c.doc_id, c.name, f"{c.name} is a city in {c.country}. "
                                               f"It has a population of {c.population}."))
    for p in people.values():
        first = p.name.split()[0]
        docs.append(Document(p.doc_id, p.name, f"{p.name} is a {p.job}. {first} was born in {p.birth_year} "
                                               f"in the city of {p.city}."))
    for c in companies.values():
        docs.append(Document(c.doc_id, c.name,
                             f"{c.name} makes {c.product} and is based in {c.city}. It has {c.employees} employees. "
                             f"It was founded in {c.founded} by {c.founder}."))
    docs.sort(key=lambda d: int(d.doc_id[1:]))
    corpus = Corpus(docs)
    tools = ToolSet(make_search_tools(corpus, k=opts.k, snippet_chars=opts.snippet_chars))
    return SearchWorld(key, cities, people, companies, corpus, tools)


def _hop(entity: str, doc_id: str, *needs: Any) -> dict[str, Any]:
    """One step of the expert: search `entity`; open `doc_id` unless the snippet shows every value in `needs`."""
    return {"entity": entity, "doc_id": doc_id, "needs": [str(v) for v in needs]}


ONE_HOP = ("company_year", "company_city", "company_employees", "person_year", "person_city", "city_country",
           "city_population")
TWO_HOP = ("founder_city", "founder_year", "company_country", "birth_city_population")


def make_question(world: SearchWorld, kind: str, rng) -> tuple[str, str, str, list[dict[str, Any]]]:
    """(prompt, answer, verifier, hops) for one question of `kind` about a random entity of `world`."""
    co = world.companies[rng.choice(sorted(world.companies))]
    pe = world.people[rng.choice(sorted(world.people))]
    ci = world.cities[rng.choice(sorted(world.cities))]
    if kind == "company_year":
        return f"What year was {co.name} founded?", str(co.founded), "numeric", [_hop(co.name, co.doc_id, co.founded)]
    if kind == "company_city":
        return f"In which city is {co.name} based?", co.city, "normalized", [_hop(co.name, co.doc_id, co.city)]
    if kind == "company_employees":
        return (f"How many employees does {co.name} have?", str(co.employees), "numeric",
                [_hop(co.name, co.doc_id, co.employees)])
    if kind == "person_year":
        return (f"In what year was {pe.name} born?", str(pe.birth_year), "numeric",
                [_hop(pe.name, pe.doc_id, pe.birth_year)])
    if kind == "person_city":
        return f"In which city was {pe.name} born?", pe.city, "normalized", [_hop(pe.name, pe.doc_id, pe.city)]
    if kind == "city_country":
        return f"In which country is {ci.name}?", ci.country, "normalized", [_hop(ci.name, ci.doc_id, ci.country)]
    if kind == "city_population":
        return (f"What is the population of {ci.name}?", str(ci.population), "numeric",
                [_hop(ci.name, ci.doc_id, ci.population)])
    founder = world.people[co.founder]
    if kind == "founder_city":
        return (f"In which city was the founder of {co.name} born?", founder.city, "normalized",
                [_hop(co.name, co.doc_id, founder.name), _hop(founder.name, founder.doc_id, founder.city)])
    if kind == "founder_year":
        return (f"In what year was the founder of {co.name} born?", str(founder.birth_year), "numeric",
                [_hop(co.name, co.doc_id, founder.name), _hop(founder.name, founder.doc_id, founder.birth_year)])
    if kind == "company_country":
        city = world.cities[co.city]
        return (f"In which country is {co.name} based?", city.country, "normalized",
                [_hop(co.name, co.doc_id, city.name), _hop(city.name, city.doc_id, city.country)])
    if kind == "birth_city_population":
        city = world.cities[pe.city]
        return (f"What is the population of the city where {pe.name} was born?", str(city.population), "numeric",
                [_hop(pe.name, pe.doc_id, city.name), _hop(city.name, city.doc_id, city.population)])
    raise ValueError(f"unknown search-qa question kind {kind!r}")


def _block_of(search_text: str, doc_id: str) -> str | None:
    """The part of a `search` observation that shows `doc_id` (its title line and snippet), if any."""
    for block in search_text.split("\n\n"):
        first = block.split("\n", 1)[0]
        if re.match(r"\[\d+\] " + re.escape(doc_id) + ":", first):
            return block
    return None


def shows(text: str, value: str) -> bool:
    return re.search(r"(?<!\w)" + re.escape(value) + r"(?!\w)", text) is not None


def hop_documents(task: Task) -> frozenset[str]:
    """The documents a search task's answer rests on (its hops'), for `TaskToolEnv`'s `evidence` signal."""
    return frozenset(hop["doc_id"] for hop in task.metadata.get("hops", ()))


def hop_actions(tools: ToolSet, hops: list[dict[str, Any]]) -> list[ToolCall]:
    """The expert's calls for `hops`: search each entity by name; open its document when the snippet lacks the
    fact the next step needs (found by running the real, deterministic search tool)."""
    calls: list[ToolCall] = []
    for hop in hops:
        search = ToolCall("search", {"query": hop["entity"]})
        calls.append(search)
        block = _block_of(tools.call(search).text, hop["doc_id"])
        if block is None or not all(shows(block, v) for v in hop["needs"]):
            calls.append(ToolCall("open", {"doc_id": hop["doc_id"]}))
    return calls


class SearchQASuite:
    name = "search-qa"

    def __init__(self, **options: Any) -> None:
        self.options = SearchQAOptions(**options)
        self._worlds = LRUCache(lambda key: build_search_world(key, self.options), capacity=256)
        self._template: ToolSet | None = None

    def world(self, task_or_key: Task | str) -> SearchWorld:
        key = task_or_key.metadata["world"] if isinstance(task_or_key, Task) else task_or_key
        return self._worlds.get(key)

    def sample_tasks(self, n: int, *, split: str = "train", seed: int = 0) -> list[Task]:
        rng = stream_rng(self.name, split, seed)
        o = self.options

        def make(w: int, i: int) -> Task:
            key = f"{split}-{seed}-{w}"
            world = self.world(key)
            kinds = TWO_HOP if rng.random() < o.two_hop_fraction else ONE_HOP
            kind = rng.choice(kinds)
            prompt, answer, verifier, hops = make_question(world, kind, rng)
            return Task(task_id=f"search-qa-{split}-{seed}-{i}", prompt=prompt, answer=answer, suite=self.name,
                        metadata={"world": key, "kind": kind, "verifier": verifier, "hops": hops})

        return sample_in_split(n, split, make, per_world=o.tasks_per_world)

    def expert_actions(self, task: Task) -> list[Action]:
        return [*hop_actions(self.world(task).tools, task.metadata["hops"]), FinalAnswer(task.answer)]

    def verify(self, task: Task, answer: str | None) -> bool:
        return verify_by_kind(task, answer)

    def make_env(self) -> TaskToolEnv:
        if self._template is None:  # the same tools over no documents: what legal_actions shows before reset
            self._template = ToolSet(make_search_tools(Corpus([]), k=self.options.k))
        return TaskToolEnv(self._template, self.verify, toolset_for=lambda task: self.world(task).tools,
                           system_prompt=SYSTEM_PROMPT, evidence=hop_documents)


SUITES.add("search-qa", SearchQASuite)
