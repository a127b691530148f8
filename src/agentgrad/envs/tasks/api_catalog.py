"""api-catalog: a large, hierarchical action space of synthetic APIs (categories -> tools), some behind a login.

The catalog is fixed (228 APIs in 16 categories: weather.get_humidity, bank.get_balance, ...), so a policy can
learn it; what the APIs answer is generated per task world (a stable hash of world, API and argument), so
answers cannot be memorised. Six categories (bank, calendar, mail, fitness, contacts, files) need a successful
`auth.login(user, pin)` first: until then `legal_actions()` leaves them out of the mask, and a call that still
arrives gets a typed `error (denied): ...` observation. Tasks need 1-3 calls: one lookup; login then a lookup;
a lookup whose answer (a city) feeds a weather lookup; or login, such a lookup, then weather. Any argument gets
an answer, but a lookup's `known_entity` signal says whether it named something in the task's world, a fact the
`known_entity` process reward pays for.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from agentgrad.envs.base import SUITES, ActionMask
from agentgrad.envs.tasks import NameMaker, fictional_word, sample_in_split, stable_int, stream_rng, verify_by_kind
from agentgrad.envs.tool_env import ToolEnv
from agentgrad.tools.base import ToolArgumentError, ToolErrorKind, ToolResult, ToolSet, validate_arguments
from agentgrad.types import Action, FinalAnswer, Task, ToolCall

SYSTEM_PROMPT = ("Call the right API (bank, calendar, mail, fitness, contacts, files need auth.login first), "
                 "then answer.")
AUTH_CATEGORY = "auth"

# category, parameter, needs login, attributes ("name" is a number; "name:city" a city; "name:word" a word)
_SPEC = (
    ("weather", "city", False, "temperature humidity wind_speed rainfall pressure uv_index visibility cloud_cover "
     "dew_point snowfall air_quality pollen_count sunrise_hour sunset_hour forecast:word"),
    ("bank", "account", True, "balance savings overdraft_limit interest_rate monthly_fee last_deposit "
     "last_withdrawal credit_score loan_amount card_limit pending_total branch:city owner:word currency:word "
     "open_year"),
    ("calendar", "date", True, "meeting_count first_meeting_hour last_meeting_hour free_hours busy_hours "
     "location:city reminder_count event_title:word attendee_count call_count deadline_count focus_hours "
     "travel_hours lunch_hour room:word"),
    ("mail", "folder", True, "unread_count total_count flagged_count spam_count draft_count oldest_year "
     "newest_sender:word top_sender:word attachment_count size_mb thread_count reply_count archived_count "
     "muted_count label:word"),
    ("maps", "place", False, "city:city distance_km travel_minutes elevation rating review_count opening_hour "
     "closing_hour parking_spots postcode street:word district:word zone:word floor_count visitor_count"),
    ("shop", "product", False, "price stock rating review_count weight_grams discount shipping_days "
     "warehouse:city seller:word color:word warranty_months return_days sold_count size:word brand:word"),
    ("flights", "flight", False, "destination:city origin:city departure_hour arrival_hour gate_number terminal "
     "seat_count free_seats price delay_minutes duration_minutes aircraft:word airline:word baggage_kg "
     "distance_km"),
    ("hotel", "hotel", False, "city:city price rating room_count free_rooms stars checkin_hour checkout_hour "
     "distance_to_center review_count pool_count floor_count chain:word breakfast_price parking_price"),
    ("music", "song", False, "artist:word album:word release_year length_seconds play_count like_count bpm "
     "chart_rank genre:word label:word track_number key:word rating mood:word hometown:city"),
    ("news", "topic", False, "headline_count top_source:word reader_count comment_count share_count author:word "
     "city:city word_count trend_rank update_hour photo_count video_count sentiment:word region:word editor:word"),
    ("stocks", "ticker", False, "price volume open_price close_price high low market_cap dividend pe_ratio "
     "sector:word exchange:word ceo:word hq_city:city employee_count founded_year"),
    ("fitness", "member", True, "steps calories heart_rate sleep_hours weight_kg height_cm workout_count "
     "distance_km active_minutes water_cups gym:word coach:word home_city:city streak_days goal_steps"),
    ("contacts", "contact", True, "city:city phone_suffix birthday_month age company:word email_domain:word "
     "team:word title:word office_floor desk_number manager:word hobby:word pet:word language:word start_year"),
    ("files", "file", True, "size_kb owner:word created_year modified_hour line_count word_count page_count "
     "share_count version folder:word format:word download_count comment_count editor:word city:city"),
    ("recipes", "dish", False, "calories prep_minutes cook_minutes servings ingredient_count rating cuisine:word "
     "chef:word origin_city:city spice_level cost protein_grams sugar_grams difficulty:word review_count"),
)

_RANGES: tuple[tuple[Callable[[str], bool], int, int], ...] = (
    (lambda a: a.endswith("_hour"), 0, 23),
    (lambda a: a.endswith("_year"), 1950, 2023),
    (lambda a: a in ("rating", "stars"), 1, 5),
    (lambda a: a in ("temperature", "dew_point"), -10, 40),
    (lambda a: a in ("humidity", "cloud_cover", "discount", "air_quality", "interest_rate", "uv_index",
                     "spice_level", "sleep_hours", "birthday_month", "age"), 1, 99),
)


@dataclass(frozen=True)
class ApiSpec:
    name: str  # "weather.get_humidity"
    category: str
    param: str | None  # the one string argument ("city"), or None for auth.*
    attr: str  # "humidity"
    kind: str  # "number" | "city" | "word" | "auth"
    auth: bool
    lo: int = 1
    hi: int = 9999

    # cached: every episode builds an env that wraps all 228 specs (env and reset took 1.0 ms, now 0.3 ms)
    @cached_property
    def parameters(self) -> dict[str, Any]:
        if self.name == "auth.login":
            return {"type": "object", "properties": {"user": {"type": "string"}, "pin": {"type": "string"}},
                    "required": ["user", "pin"]}
        if self.param is None:
            return {"type": "object", "properties": {}, "required": []}
        return {"type": "object", "properties": {self.param: {"type": "string"}}, "required": [self.param]}

    @cached_property
    def description(self) -> str:
        if self.kind == "auth":
            return {"login": "Log in with a user name and pin.", "logout": "Log out.",
                    "whoami": "Show the logged-in user."}[self.attr]
        return f"Get the {self.attr.replace('_', ' ')} of a {self.param}." + (" Needs login." if self.auth else "")


@lru_cache(maxsize=1)
def catalog() -> tuple[ApiSpec, ...]:
    """Every API, in a fixed order: auth.login, auth.logout, auth.whoami, then category by category."""
    specs = [ApiSpec(f"auth.{a}", AUTH_CATEGORY, None, a, "auth", False) for a in ("login", "logout", "whoami")]
    for category, param, auth, attrs in _SPEC:
        for item in attrs.split():
            attr, _, kind = item.partition(":")
            lo, hi = next(((lo, hi) for test, lo, hi in _RANGES if test(attr)), (1, 9999))
            specs.append(ApiSpec(f"{category}.get_{attr}", category, param, attr, kind or "number", auth, lo, hi))
    names = [s.name for s in specs]
    assert len(set(names)) == len(names), "duplicate API names"
    return tuple(specs)


@lru_cache(maxsize=4096)
def world_cities(world: str) -> tuple[str, ...]:
    return tuple(NameMaker(random.Random(stable_int("api-world", world))).word() for _ in range(6))


def _normal(arg: str) -> str:
    return " ".join(arg.lower().split())


def api_value(world: str, spec: ApiSpec, arg: str) -> str:
    """What `spec` answers for `arg` in `world`: a pure function of the three (argument case and spaces ignored)."""
    h = stable_int("api", world, spec.name, _normal(arg))
    if spec.kind == "city":
        cities = world_cities(world)
        return cities[h % len(cities)]
    if spec.kind == "word":
        return fictional_word(random.Random(h), 2)
    return str(spec.lo + h % (spec.hi - spec.lo + 1))


def _known_entities(task: Task) -> frozenset[str]:
    """What exists in a task's world: the entities its expert calls name (the one in the question, the city a
    chain's first lookup yields) and the world's cities."""
    named = (v for name, args in task.metadata["calls"] if not name.startswith(f"{AUTH_CATEGORY}.")
             for v in args.values())
    return frozenset(_normal(v) for v in (*named, *world_cities(task.metadata["world"])))


class ApiTool:
    """One synthetic API as a Tool: validated arguments, then the env's handler (which holds the login state)."""

    def __init__(self, spec: ApiSpec, handler: Callable[[ApiSpec, dict[str, Any]], ToolResult]) -> None:
        self.spec = spec
        self.name = spec.name
        self.category = spec.category
        self.description = spec.description
        self.parameters = spec.parameters
        self._handler = handler

    def __call__(self, **arguments: Any) -> ToolResult:
        try:
            args = validate_arguments(self.parameters, arguments)
        except ToolArgumentError as exc:
            return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, str(exc))
        return self._handler(self.spec, args)


@lru_cache(maxsize=1)
def _login_masks() -> tuple[frozenset[str], ActionMask, ActionMask]:
    """The login-only API names, the mask once logged in (every API), and the mask before (the public ones)."""
    specs = catalog()
    full = ActionMask(categories=frozenset(s.category for s in specs), tools=frozenset(s.name for s in specs))
    public = ActionMask(categories=frozenset(s.category for s in specs if not s.auth),
                        tools=frozenset(s.name for s in specs if not s.auth))
    return frozenset(s.name for s in specs if s.auth), full, public


class ApiCatalogEnv(ToolEnv):
    """ToolEnv over the catalog with login state: the mask hides login-only APIs until `auth.login` succeeds."""

    def __init__(self, verify: Callable[[Task, str | None], bool], *, schemas: str = "all") -> None:
        super().__init__(ToolSet([ApiTool(s, self._handle) for s in catalog()]), verify, system_prompt=SYSTEM_PROMPT)
        self.schemas = schemas
        self._user: str | None = None
        self._auth_names, self._full_mask, self._public_mask = _login_masks()

    @property
    def logged_in(self) -> bool:
        return self._user is not None

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        obs, info = super().reset(seed=seed, options=options)
        self._user = None
        return obs, info

    def prompt_schemas(self) -> list[dict[str, Any]]:
        return super().prompt_schemas() if self.schemas == "all" else []

    def legal_actions(self) -> ActionMask:
        return self._full_mask if self._user is not None else self._public_mask

    def snapshot(self) -> tuple[tuple[Action, ...], str | None, bool]:
        """The whole episode state (`envs/base.py: SnapshotEnv`): the calls so far, who is logged in, whether it
        ended. The catalog's APIs are pure functions of the task's world, so nothing else changes."""
        return tuple(self.history), self._user, self._done

    def restore(self, state: tuple[tuple[Action, ...], str | None, bool]) -> None:
        if self._task is None:
            raise RuntimeError("restore needs reset(options={'task': ...}) first")
        history, self._user, self._done = state
        self.history = list(history)

    def step(self, action: Action) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if (isinstance(action, ToolCall) and action.name in self._auth_names and self._user is None
                and not self._done and self._task is not None):
            self.history.append(action)
            obs = ToolResult.error(ToolErrorKind.DENIED, f"{action.name} needs auth.login first").text
            return obs, 0.0, False, False, {"tool_ok": False, "tool_error": "denied", "signals": {"needs_login": True}}
        return super().step(action)

    def _handle(self, spec: ApiSpec, args: dict[str, Any]) -> ToolResult:
        task = self._task
        if task is None:
            return ToolResult.error(ToolErrorKind.CRASHED, "no task (call reset first)")
        if spec.kind == "auth":
            if spec.attr == "login":
                if args["user"].strip() == task.metadata["user"] and args["pin"].strip() == task.metadata["pin"]:
                    self._user = task.metadata["user"]
                    return ToolResult(f"logged in as {self._user}", signals={"logged_in": True})
                return ToolResult.error(ToolErrorKind.DENIED, "wrong user or pin", logged_in=False)
            if spec.attr == "logout":
                self._user = None
                return ToolResult("logged out", signals={"logged_in": False})
            return ToolResult(f"user: {self._user}" if self._user else "not logged in",
                              signals={"logged_in": self._user is not None})
        if spec.auth and self._user is None:  # reachable only when the handler is called directly
            return ToolResult.error(ToolErrorKind.DENIED, f"{spec.name} needs auth.login first", needs_login=True)
        arg = args[spec.param]
        if not arg.strip():
            return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, f"{spec.param} is empty")
        if len(arg) > 100:
            return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, f"{spec.param} longer than 100 characters")
        value = api_value(task.metadata["world"], spec, arg)
        # any argument gets an answer (a miscopied name is not an error), but whether it names something in this
        # world is a verifiable fact: a process reward can pay for copying names right (`known_entity`)
        return ToolResult(f"{spec.attr}: {value}", signals={"api": spec.name,
                                                            "known_entity": _normal(arg) in _known_entities(task)})


# ---- tasks ----------------------------------------------------------------------------------------------------

_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")


def _entity(param: str, rng: random.Random) -> str:
    if param == "account":
        return str(rng.randint(1000, 9999))
    if param == "flight":
        return "".join(rng.choice(_LETTERS) for _ in range(2)) + str(rng.randint(100, 999))
    if param == "ticker":
        return "".join(rng.choice(_LETTERS) for _ in range(4))
    if param == "date":
        return f"{rng.choice(_MONTHS)} {rng.randint(1, 28)}"
    if param == "file":
        return fictional_word(rng, 2).lower() + ".txt"
    return fictional_word(rng, 2)


KINDS = ("single", "auth_single", "chain", "auth_chain")


@dataclass(frozen=True)
class ApiCatalogOptions:
    kinds: tuple[str, ...] | None = None  # default: every kind
    schemas: str = "all"  # "all": every API's schema goes to the prompt; "none": none (names learnt from demos)

    def __post_init__(self) -> None:
        if self.kinds is not None:
            object.__setattr__(self, "kinds", tuple(self.kinds))
            if not self.kinds or set(self.kinds) - set(KINDS):
                raise ValueError(f"api-catalog kinds must be a non-empty subset of {KINDS}, got {self.kinds}")
        if self.schemas not in ("all", "none"):
            raise ValueError(f"api-catalog schemas must be 'all' or 'none', got {self.schemas!r}")


class ApiCatalogSuite:
    name = "api-catalog"

    def __init__(self, **options: Any) -> None:
        self.options = ApiCatalogOptions(**options)
        specs = catalog()
        self._lookups = {auth: [s for s in specs if s.kind != "auth" and s.auth == auth and s.category != "weather"]
                         for auth in (False, True)}
        self._links = {auth: [s for s in specs if s.kind == "city" and s.auth == auth] for auth in (False, True)}
        self._weather = [s for s in specs if s.category == "weather" and s.kind == "number"]

    def sample_tasks(self, n: int, *, split: str = "train", seed: int = 0) -> list[Task]:
        rng = stream_rng(self.name, split, seed)
        kinds = self.options.kinds or KINDS
        weather_lookups = [s for s in catalog() if s.category == "weather"]

        def make(_world: int, i: int) -> Task:
            world = f"{split}-{seed}-{i}"  # one world per task
            kind = rng.choice(kinds)
            auth = kind.startswith("auth")
            user, pin = fictional_word(rng, 2).lower(), str(rng.randint(1000, 9999))
            calls: list[list[Any]] = [["auth.login", {"user": user, "pin": pin}]] if auth else []
            if kind.endswith("single"):
                pool = self._lookups[auth] + ([] if auth else weather_lookups)
                spec = rng.choice(pool)
                arg = _entity(spec.param, rng)
                question = f"What is the {spec.attr.replace('_', ' ')} of {spec.param} {arg}?"
                calls.append([spec.name, {spec.param: arg}])
                answer = api_value(world, spec, arg)
                final = spec
            else:
                link, final = rng.choice(self._links[auth]), rng.choice(self._weather)
                arg = _entity(link.param, rng)
                city = api_value(world, link, arg)
                question = (f"What is the {final.attr.replace('_', ' ')} in the {link.attr.replace('_', ' ')} "
                            f"of {link.param} {arg}?")
                calls += [[link.name, {link.param: arg}], [final.name, {"city": city}]]
                answer = api_value(world, final, city)
            prompt = f"Log in as {user} (pin {pin}). {question}" if auth else question
            return Task(task_id=f"api-catalog-{split}-{seed}-{i}", prompt=prompt, answer=answer, suite=self.name,
                        metadata={"world": world, "kind": kind, "user": user, "pin": pin, "calls": calls,
                                  "verifier": "numeric" if final.kind == "number" else "normalized"})

        return sample_in_split(n, split, make)

    def expert_actions(self, task: Task) -> list[Action]:
        return [*(ToolCall(name, dict(args)) for name, args in task.metadata["calls"]), FinalAnswer(task.answer)]

    def verify(self, task: Task, answer: str | None) -> bool:
        return verify_by_kind(task, answer)

    def make_env(self) -> ApiCatalogEnv:
        return ApiCatalogEnv(self.verify, schemas=self.options.schemas)


SUITES.add("api-catalog", ApiCatalogSuite)
