"""The structured-output workloads: `json_extract` and `tool_call` (docs/design.md §4d).

Built offline and deterministic for (n, seed), like the other workloads (workloads.py); every
item carries the grammar its answer must follow, so `bench compare` runs them constrained.

- ``json_extract``: a passage and a JSON schema to fill from it, the schema one of three shapes
  with nested objects, enums and arrays: a stdlib module's card (its documentation is the
  passage), an event record and an order record (passages written here from seeded values).
  The answer's keys, quotes and braces are forced by the schema, its values come from the
  passage.
- ``tool_call``: a list of 3-5 tools (JSON schema parameters) and a request that one of them
  serves; the output is constrained as the server constrains `tool_choice: "required"` with
  `parallel_tool_calls: false` (server/tools.py): `{"name": <a tool>, "arguments": <its
  parameters>}`. The tools are shown in the message itself, so a chat template without a
  `tools` variable shows them too.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from dynaspec.structured_params import StructuredOutputParams, schema_text

_ENUM_KINDS = ["library", "tool", "protocol", "data format"]
_CITIES = [("Lisbon", "Portugal"), ("Osaka", "Japan"), ("Quito", "Ecuador"), ("Tartu", "Estonia"),
           ("Perth", "Australia"), ("Lyon", "France"), ("Accra", "Ghana"), ("Bergen", "Norway")]
_PEOPLE = ["Ana Ruiz", "Kenji Sato", "Mara Olsen", "Tomas Varga", "Ines Duarte", "Femi Adeyemi",
           "Lena Fischer", "Ravi Menon", "Sofia Rossi", "Owen Price"]
_ROLES = ["speaker", "organizer", "guest"]
_STATUS = ["scheduled", "postponed", "cancelled"]
_PRODUCTS = [("KB-104", "keyboard"), ("MS-220", "mouse"), ("CB-031", "cable"),
             ("HD-550", "headset"), ("LP-900", "laptop stand"), ("WC-120", "webcam")]
_UNITS = ["piece", "box", "pack"]
_PRIORITY = ["low", "normal", "urgent"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December"]


def _obj(props: dict, *required: str) -> dict:
    return {"type": "object", "properties": props, "required": list(required or props),
            "additionalProperties": False}


_STR = {"type": "string", "maxLength": 60}
MODULE_SCHEMA = _obj({
    "module": _STR, "kind": {"enum": _ENUM_KINDS},
    "summary": {"type": "string", "maxLength": 200},
    "topics": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
    "details": _obj({"has_examples": {"type": "boolean"}, "mentions_classes": {"type": "boolean"},
                     "first_name_defined": _STR}),
})
EVENT_SCHEMA = _obj({
    "title": _STR,
    "date": _obj({"year": {"type": "integer"}, "month": {"enum": _MONTHS},
                  "day": {"type": "integer", "minimum": 1, "maximum": 31}}),
    "location": _obj({"city": _STR, "country": _STR}),
    "status": {"enum": _STATUS},
    "participants": {"type": "array", "maxItems": 4,
                     "items": _obj({"name": _STR, "role": {"enum": _ROLES}})},
})
ORDER_SCHEMA = _obj({
    "order_id": _STR,
    "customer": _obj({"name": _STR, "email": _STR}),
    "items": {"type": "array", "maxItems": 4,
              "items": _obj({"sku": _STR, "quantity": {"type": "integer", "minimum": 1},
                             "unit": {"enum": _UNITS}})},
    "priority": {"enum": _PRIORITY},
    "paid": {"type": "boolean"},
})


def _module_task(rng: random.Random, docs) -> tuple[str, dict]:
    rel, parts = docs[rng.randrange(len(docs))]
    name = rel.removesuffix(".py").replace("/", ".")
    return (f"Documentation of the Python module {name}:\n\n{parts[0][:1200]}\n\nFill the JSON "
            "schema from it: module, kind, summary (its first sentence, word for word), up to "
            "three topics, and details."), MODULE_SCHEMA


def _event_task(rng: random.Random, docs) -> tuple[str, dict]:
    city, country = rng.choice(_CITIES)
    people = rng.sample(_PEOPLE, rng.randint(2, 4))
    roles = [rng.choice(_ROLES) for _ in people]
    day, month, year = rng.randint(1, 28), rng.choice(_MONTHS), rng.randint(2019, 2027)
    title = f"{rng.choice(['Spring', 'Open', 'Annual', 'Regional'])} " \
            f"{rng.choice(['Data', 'Robotics', 'Poetry', 'Chess'])} " \
            f"{rng.choice(['Forum', 'Meetup', 'Summit'])}"
    who = ", ".join(f"{p} ({r})" for p, r in zip(people, roles))
    text = (f"The {title} takes place in {city}, {country} on {month} {day}, {year}. Its status "
            f"is {rng.choice(_STATUS)}. Taking part: {who}.")
    return f"{text}\n\nExtract the event as JSON following the schema.", EVENT_SCHEMA


def _order_task(rng: random.Random, docs) -> tuple[str, dict]:
    name = rng.choice(_PEOPLE)
    lines = rng.sample(_PRODUCTS, rng.randint(1, 4))
    items = "; ".join(f"{rng.randint(1, 12)} {rng.choice(_UNITS)}(s) of {what} ({sku})"
                      for sku, what in lines)
    email = name.lower().replace(" ", ".") + "@example.org"
    text = (f"Order A-{rng.randint(1000, 9999)} from {name} <{email}>: {items}. Priority "
            f"{rng.choice(_PRIORITY)}; {'paid by card' if rng.random() < 0.5 else 'not paid'}.")
    return f"{text}\n\nExtract the order as JSON following the schema.", ORDER_SCHEMA


_EXTRACT_TASKS: tuple[Callable, ...] = (_module_task, _event_task, _order_task)


def _s(desc: str, **kw) -> dict:
    return {"type": "string", "description": desc, **kw}


TOOLS: tuple[dict, ...] = (
    {"name": "get_weather", "description": "Current weather in a city",
     "parameters": _obj({"city": _s("city name"), "unit": {"enum": ["celsius", "fahrenheit"]}})},
    {"name": "search_files", "description": "Search the user's files",
     "parameters": _obj({"query": _s("words to find"),
                         "max_results": {"type": "integer", "minimum": 1, "maximum": 50}})},
    {"name": "create_event", "description": "Add an event to the calendar",
     "parameters": _obj({"title": _s("event title"),
                         "date": _obj({"year": {"type": "integer"}, "month": {"enum": _MONTHS},
                                       "day": {"type": "integer", "minimum": 1,
                                               "maximum": 31}}),
                         "attendees": {"type": "array", "items": _s("a name"), "maxItems": 4}})},
    {"name": "send_email", "description": "Send an email",
     "parameters": _obj({"to": _s("address"), "subject": _s("subject line", maxLength=80),
                         "body": _s("message text", maxLength=300)})},
    {"name": "convert_currency", "description": "Convert an amount between currencies",
     "parameters": _obj({"amount": {"type": "number"},
                         "source": {"enum": ["EUR", "USD", "JPY", "GBP"]},
                         "target": {"enum": ["EUR", "USD", "JPY", "GBP"]}})},
    {"name": "set_timer", "description": "Start a countdown timer",
     "parameters": _obj({"minutes": {"type": "integer", "minimum": 1, "maximum": 180},
                         "label": _s("what it is for")})},
)


def _tool_request(rng: random.Random, name: str) -> str:
    city, _ = rng.choice(_CITIES)
    person = rng.choice(_PEOPLE)
    return {
        "get_weather": f"Is it cold in {city} right now? Answer in {rng.choice(['C', 'F'])}.",
        "search_files": f"Find my notes about the {rng.choice(['budget', 'trip', 'garden'])}, "
                        f"at most {rng.randint(2, 20)} results.",
        "create_event": f"Put a meeting with {person} on my calendar for {rng.choice(_MONTHS)} "
                        f"{rng.randint(1, 28)}, {rng.randint(2025, 2027)}, titled "
                        f"'{rng.choice(['Planning', 'Review', 'Lunch'])}'.",
        "send_email": f"Email {person.split()[0].lower()}@example.org that the "
                      f"{rng.choice(['report', 'invoice', 'draft'])} is ready.",
        "convert_currency": f"How much is {rng.randint(5, 900)} "
                            f"{rng.choice(['euros', 'dollars', 'pounds'])} in yen?",
        "set_timer": f"Set a timer for {rng.randint(2, 90)} minutes for the "
                     f"{rng.choice(['pasta', 'laundry', 'break'])}.",
    }[name]


def required_call_schema(tools: list[dict]) -> dict:
    """The schema of one call to one of `tools`: the server's `tool_choice: "required"` with
    `parallel_tool_calls: false` (server/tools.py)."""
    return {"anyOf": [_obj({"name": {"enum": [t["name"]]}, "arguments": t["parameters"]})
                      for t in tools]}


def json_extract(tokenizer, n: int, seed: int, chat_ids, pick, docs, item_cls) -> list:
    rng = random.Random(seed)
    tasks = pick([t for t in _EXTRACT_TASKS if docs or t is not _module_task], n, rng)
    items = []
    for i, task in enumerate(tasks):
        text, schema = task(rng, docs)
        content = f"{text}\n\nSchema: {json.dumps(schema)}\nAnswer with the JSON object only."
        items.append(item_cls(chat_ids(tokenizer, content), 256,
                              f"json_extract:{task.__name__.strip('_')}:{i}",
                              StructuredOutputParams(json=schema_text(schema))))
    return items


def tool_call(tokenizer, n: int, seed: int, chat_ids, item_cls) -> list:
    rng = random.Random(seed)
    items = []
    for i in range(n):
        tools = rng.sample(TOOLS, rng.randint(3, 5))
        target = rng.choice(tools)["name"]
        shown = [{"type": "function", "function": t} for t in tools]
        content = (f"Tools you can call:\n{json.dumps(shown)}\n\nUser: "
                   f"{_tool_request(rng, target)}\n\nCall exactly one tool: answer with "
                   '{"name": ..., "arguments": {...}}.')
        items.append(item_cls(chat_ids(tokenizer, content), 160, f"tool_call:{target}:{i}",
                              StructuredOutputParams(json=schema_text(required_call_schema(tools)))))
    return items
