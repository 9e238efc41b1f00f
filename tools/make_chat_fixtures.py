#!/usr/bin/env python3
"""Truth fixtures for loramux's chat templates: Python jinja2 renders, through transformers itself.

Writes tests/tokenizer/chat_fixtures/{qwen3,deepseek-v3,harmony,jinja}.json. The first three render a set of
conversations with transformers' tokenizer.apply_chat_template(..., tokenize=False) — so message
normalization, special-token variables and the jinja2 environment (trim_blocks, lstrip_blocks, loopcontrols,
tojson, raise_exception, namespace) are exactly what Hugging Face users get. harmony.json uses the GPT-OSS
tokenizer with our own templates/harmony.jinja. jinja.json renders small templates, one per interpreter
feature, with the same compiled environment (transformers' _compile_jinja_template). A case whose render
raises stores "error" (the exception text) instead of "expected"; the C++ tests then require a failure.

    /opt/tv/bin/python tools/make_chat_fixtures.py            # from the repository root

Deterministic: no clock is read (cases pass current_date), dict order is insertion order, output is
json.dumps(indent=1, ensure_ascii=False) — rerun and `git diff tests/tokenizer/chat_fixtures`.
"""

import argparse
import json
import os
import sys

from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import _compile_jinja_template

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.normpath(os.path.join(ROOT, "..", "shared", "data", "tokenizers"))

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Gets the current weather in the provided location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
            },
            "required": ["location"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Current time — UTC, «ISO-8601».", "parameters": {"type": "object", "properties": {}}}}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search documents.\nReturns the top hits.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "Free text"},
                "limit": {"type": "integer", "default": 10},
                "tags": {"type": "array", "items": {"type": "string"}, "description": "Filter by tags"},
                "exact": {"type": "boolean"},
                "range": {"type": "object", "properties": {"from": {"type": "number"}, "to": {"type": ["number", "null"]}}, "required": ["from"]},
            },
            "required": ["query"],
        },
    },
}


def call(name, arguments, call_id=None):
    c = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id:
        c["id"] = call_id
    return c


def conversations(flavor):
    """Cases shared by every template; `flavor` only changes tool-call argument encoding (DeepSeek's template
    concatenates arguments, so they must be strings there)."""
    args = (lambda d: json.dumps(d, ensure_ascii=False)) if flavor == "deepseek" else (lambda d: d)
    u = lambda text: {"role": "user", "content": text}
    a = lambda text, **kw: {"role": "assistant", "content": text, **kw}
    s = lambda text: {"role": "system", "content": text}
    t = lambda text, **kw: {"role": "tool", "content": text, **kw}
    cases = [
        ("single_user_prompt", [u("Hello!")], {"add_generation_prompt": True}),
        ("single_user_no_prompt", [u("Hello!")], {"add_generation_prompt": False}),
        ("system_multi_turn", [s("You are terse."), u("2+2?"), a("4."), u("And 3+3?")], {"add_generation_prompt": True}),
        ("multi_turn_no_system", [u("Hi"), a("Hello, how can I help?"), u("Tell me a joke."), a("Why did the chicken cross the road?")], {}),
        ("tools_offered", [s("Be helpful."), u("What's the weather in Paris?")], {"tools": [WEATHER_TOOL, TIME_TOOL], "add_generation_prompt": True}),
        ("tools_no_system", [u("What time is it?")], {"tools": [TIME_TOOL, SEARCH_TOOL], "add_generation_prompt": True}),
        ("tool_call_round_trip", [
            u("Weather in Tokyo?"),
            a("", tool_calls=[call("get_current_weather", args({"location": "Tokyo", "format": "celsius"}), "c1")]),
            t('{"temperature": 20, "sunny": true}', name="get_current_weather"),
            a("It is 20°C and sunny in Tokyo."),
        ], {"tools": [WEATHER_TOOL]}),
        ("tool_call_args_string", [
            u("Search for llamas"),
            a("Let me search.", tool_calls=[call("search", '{"query": "llamas", "limit": 3}')]),
            t("[\"llama 1\", \"llama 2\"]"),
        ], {"tools": [SEARCH_TOOL], "add_generation_prompt": True}),
        ("parallel_tool_calls", [
            s("Use tools."),
            u("Weather in Paris and Rome, and the time?"),
            a("", tool_calls=[call("get_current_weather", args({"location": "Paris"})), call("get_current_weather", args({"location": "Rome"})), call("get_time", args({}))]),
            t("rainy, 12"), t("sunny, 25"), t("10:00Z"),
        ], {"tools": [WEATHER_TOOL, TIME_TOOL], "add_generation_prompt": True}),
        ("reasoning_content_last", [u("Why is the sky blue?"), a("Rayleigh scattering.", reasoning_content="Short wavelengths scatter more.\n")], {}),
        ("reasoning_content_history", [
            u("Q1"), a("A1", reasoning_content="thought 1"), u("Q2"), a("A2", reasoning_content="thought 2"),
        ], {"add_generation_prompt": False}),
        ("think_tags_in_content", [u("Compute 6*7"), a("<think>\n6*7=42\n</think>\n\n42")], {}),
        ("reasoning_alias_thinking", [u("Hi"), a("Hello.", thinking="Greet back.")], {}),
        ("enable_thinking_false", [u("Quick answer: capital of France?")], {"add_generation_prompt": True, "enable_thinking": False}),
        ("enable_thinking_true", [u("Quick answer: capital of France?")], {"add_generation_prompt": True, "enable_thinking": True}),
        ("empty_contents", [s(""), u(""), a(""), u("still there?")], {"add_generation_prompt": True}),
        ("unicode", [
            s("Réponds en français. 日本語も OK. עברית."),
            u("Emoji 👩‍💻🎉, combining e\u0301, CJK 漢字, quotes \"'` and backslash \\ tab\tend"),
            a("D'accord — «très bien» ✓"),
        ], {"add_generation_prompt": True}),
        ("special_strings_and_whitespace", [u("  leading and trailing  \n\n  <|im_end|> {{ not jinja }} {% raw %}\n"), a("\n\nok\n\n")], {"add_generation_prompt": True}),
        ("two_system_messages", [s("Rule one."), s("Rule two."), u("Go.")], {"add_generation_prompt": True}),
        ("tool_response_user_content", [
            u("Find X"),
            a("", tool_calls=[call("search", args({"query": "X"}))]),
            t("X is at 1"),
            u("<tool_response>\nmanual\n</tool_response>"),
        ], {"tools": [SEARCH_TOOL], "add_generation_prompt": True}),
        ("assistant_content_none_with_tool_calls", [
            u("Time?"),
            {"role": "assistant", "content": None, "tool_calls": [call("get_time", args({}))]},
            t("09:00"),
        ], {"tools": [TIME_TOOL], "add_generation_prompt": True}),
        ("extra_kwargs", [u("Hi")], {"add_generation_prompt": True, "custom_flag": "x", "bos_token": "<BOS-OVERRIDE>"}),
    ]
    return cases


def render_model(tokenizer, template, cases):
    out = []
    for name, messages, kwargs in cases:
        case = {"name": name, "messages": messages, "kwargs": kwargs}
        kw = dict(kwargs)
        tools = kw.pop("tools", None)
        agp = kw.pop("add_generation_prompt", False)
        try:
            case["expected"] = tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=agp, tokenize=False, chat_template=template, **kw)
        except Exception as e:  # noqa: BLE001 - every failure is a fixture outcome
            case["error"] = f"{type(e).__name__}: {e}"
        out.append(case)
    return out


# (name, template, variables): one per interpreter feature; rendered with transformers' compiled environment.
JINJA_CASES = [
    ("text_only", "plain text\nline 2\n", {}),
    ("print_vars", "{{ a }}|{{ b }}|{{ c }}|{{ d }}|{{ e }}|{{ f }}", {"a": "s", "b": 3, "c": 2.5, "d": True, "e": None, "f": [1, "x", None, {"k": False}]}),
    ("undefined_prints_empty", "[{{ nope }}][{{ nope is defined }}][{{ nope | length }}][{{ 'x' ~ nope }}]", {}),
    ("undefined_attr_strict", "{{ nope.attr }}", {}),
    ("missing_key_is_undefined", "[{{ d.missing }}][{{ d['missing'] is defined }}][{{ d.k }}]", {"d": {"k": 1}}),
    ("none_attr_undefined", "[{{ n.x }}][{{ n['x'] }}]", {"n": None}),
    ("undefined_plus_fails", "{{ 'a' + nope }}", {}),
    ("comment", "a{# hidden #}b{#- trims -#}  c", {}),
    ("ws_control", "a  {{- 'b' -}}  c\n  {%- if true -%}  d  {%- endif -%}\n  e", {}),
    ("trim_lstrip_blocks", "<ul>\n  {% for x in xs %}\n    <li>{{ x }}</li>\n  {% endfor %}\n</ul>\n", {"xs": [1, 2]}),
    ("plus_disables_lstrip", "a\n  {%+ if true %}b{% endif %}\n", {}),
    ("comment_lstrip_trim", "x\n  {# c #}\ny\n", {}),
    ("raw_block", "{% raw %}{{ not evaluated }} {% if %}{% endraw %}!", {}),
    ("crlf_newlines", "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc\r\n", {}),
    ("literals", "{{ 'it\\'s' }} {{ \"q\\\"\" }} {{ 'a' 'b' }} {{ 1_000 }} {{ 1.5e3 }} {{ [1, [2, 3]] }} {{ {'a': 1, 'b': [true]} }} {{ (1,) }} {{ () }} {{ '\\u00e9\\x41\\n' }}", {}),
    ("arithmetic", "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 2.5 }} {{ 'ab' * 3 }} {{ [1] + [2] }} {{ -(3) }} {{ 10 - 2 - 3 }} {{ 2 * 3 + 4 }}", {}),
    ("float_repr", "{{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ 0.00001 }} {{ 1.0 }} {{ -2.5e-7 }} {{ 123.456 }}", {}),
    ("concat_tilde", "{{ 1 ~ 'a' ~ none ~ true ~ [1] }}", {}),
    ("comparisons", "{{ 1 < 2 < 3 }} {{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' < 'b' }} {{ [1, 2] == [1, 2] }} {{ 'x' != 'y' }} {{ 3 >= 3 }} {{ none == none }}", {}),
    ("logic", "{{ true and 'x' }} {{ false or 'y' }} {{ not 0 }} {{ '' or [] }} {{ none and 1 }} {{ not (1 and 0) }}", {}),
    ("membership", "{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'z' not in 'abc' }} {{ 'x' in nope }}", {}),
    ("ternary", "{{ 'yes' if x else 'no' }} {{ 'yes' if not x else 'no' }}[{{ 'only' if false }}]", {"x": 1}),
    ("tests", "{{ x is defined }} {{ y is undefined }} {{ n is none }} {{ s is string }} {{ d is mapping }} {{ l is iterable }} {{ 3 is number }} {{ true is number }} {{ l is sequence }} {{ true is true }} {{ 0 is false }} {{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 1 is equalto 1 }} {{ s is eq 'str' }} {{ 3 is integer }} {{ 3.0 is float }} {{ 'ab' is lower }} {{ nope is iterable }} {{ n is not none }} {{ 'x' is in 'xyz' }} {{ f is callable }}", {"x": 1, "n": None, "s": "str", "d": {}, "l": [1]}),
    ("for_loop_vars", "{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}[{{ loop.previtem }}|{{ loop.nextitem }}]{{ loop.cycle('a', 'b') }};{% endfor %}", {"xs": ["p", "q", "r"]}),
    ("for_else_and_filter", "{% for x in xs if x > 1 %}{{ x }}:{{ loop.index }}/{{ loop.length }} {% else %}empty{% endfor %}|{% for x in [] %}x{% else %}none{% endfor %}", {"xs": [1, 2, 3]}),
    ("for_unpack_items", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}{% for a, b in [[1, 2], (3, 4)] %}{{ a + b }}{% endfor %}", {"d": {"z": 1, "a": 2}}),
    ("for_string_and_nested", "{% for c in 'hé' %}[{{ c }}]{% endfor %}{% for i in [1, 2] %}{% for j in [3, 4] %}{{ loop.index }}{% endfor %}{{ loop.index }}{% endfor %}", {}),
    ("break_continue", "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% endif %}{{ i }}{% endfor %}", {}),
    ("loop_scoping", "{% set x = 1 %}{% for i in [1, 2] %}{{ x }}{% set x = 7 %}{{ x }}{% endfor %}{{ x }}{% for i in [1, 2] %}{% if loop.first %}{% set y = 5 %}{% endif %}[{{ y }}]{% endfor %}", {}),
    ("if_elif_else", "{% for v in [1, 2, 3] %}{% if v == 1 %}one{% elif v == 2 %}two{% else %}many{% endif %} {% endfor %}", {}),
    ("set_and_tuple_set", "{% set a = 1 %}{% set b, c = 2, 3 %}{{ a + b + c }}{% set s = 'x' ~ a %}{{ s }}", {}),
    ("block_set", "{% set body %}\n  Hello {{ name }}\n{% endset %}[{{ body }}]{% set t | upper | trim %} hi {% endset %}[{{ t }}]", {"name": "Ann"}),
    ("namespace", "{% set ns = namespace(n=0, items=[]) %}{% for i in [1, 2, 3] %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}{{ ns.items }}", {}),
    ("macro_defaults_kwargs", "{% macro greet(name, greeting='Hello', punct='!') %}{{ greeting }}, {{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }} {{ greet('Bob', punct='?') }} {{ greet(greeting='Hi', name='Cy') }}", {}),
    ("macro_recursion_varargs", "{% macro fact(n) %}{{ 1 if n <= 1 else n * (fact(n - 1) | int) }}{% endmacro %}{{ fact(5) }}{% macro v(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ v(1, 2, 3) }}", {}),
    ("call_block", "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}bold {{ 1 + 1 }}{% endcall %}{% macro each(xs) %}{% for x in xs %}{{ caller(x) }}{% endfor %}{% endmacro %}{% call(x) each([1, 2]) %}<{{ x }}>{% endcall %}", {}),
    ("filter_block", "{% filter upper %}shout {{ 'it' }}{% endfilter %}", {}),
    ("with_block", "{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}[{{ a }}]", {}),
    ("generation_tag", "{% generation %}assistant text{% endgeneration %}", {}),
    ("string_filters", "{{ '  pad  ' | trim }}|{{ 'xxhixx' | trim('x') }}|{{ 'Hello' | upper }}{{ 'Hello' | lower }}|{{ 'hello wORLD-foo (bar)' | title }}|{{ 'hELLO world' | capitalize }}|{{ 'aXbXc' | replace('X', '-') }}|{{ 'aaa' | replace('a', 'b', 2) }}|{{ 'abc' | reverse }}|{{ 42 | string }}|{{ 'x' | safe }}|{{ 'one two  three' | wordcount }}", {}),
    ("indent_filter", "[{{ 'a\\nb\\n\\nc' | indent }}][{{ 'a\\nb' | indent(2, true) }}][{{ 'a\\n\\nb' | indent(width=1, blank=true) }}][{{ 'a\\nb' | indent('> ') }}]", {}),
    ("tojson_filter", "{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ 'é\"\\n' | tojson }}|{{ [] | tojson(indent=2) }}|{{ d | tojson(sort_keys=true) }}|{{ d | tojson(separators=(',', ':')) }}|{{ 1.0 | tojson }}|{{ none | tojson }}", {"d": {"b": [1, 2.5, None, True], "a": {"x": "ü", "e": {}}}}),
    ("tojson_undefined_fails", "{{ nope | tojson }}", {}),
    ("sequence_filters", "{{ xs | length }} {{ xs | count }} {{ xs | join(', ') }} {{ xs | first }} {{ xs | last }} {{ xs | reverse | list }} {{ 'ab' | list }} {{ xs | sort | join }} {{ xs | unique | list }} {{ xs | sum }} {{ xs | min }} {{ xs | max }} {{ [] | first is defined }}", {"xs": [3, 1, 2, 3]}),
    ("dict_filters", "{{ d | items | list }} {{ d | length }} {{ d | list }} {{ d | dictsort }} {{ d | first }}", {"d": {"b": 1, "a": 2}}),
    ("default_filter", "{{ nope | default('dflt') }} {{ '' | default('e') }} {{ '' | default('e', true) }} {{ none | d('n') }} {{ 0 | default(5, boolean=true) }}", {}),
    ("int_float_filters", "{{ '42' | int }} {{ 3.9 | int }} {{ 'x' | int }} {{ 'x' | int(7) }} {{ ' 12 ' | int }} {{ '2.5' | int }} {{ '2.5' | float }} {{ 3 | float }} {{ -3 | abs }} {{ 2.567 | round(2) }}", {}),
    ("map_select", "{{ users | map(attribute='name') | join(',') }} {{ users | selectattr('admin') | map(attribute='name') | list }} {{ users | rejectattr('admin') | map(attribute='name') | list }} {{ users | selectattr('age', 'gt', 30) | map(attribute='name') | first }} {{ [1, 2, 3, 4] | select('odd') | list }} {{ [1, 2, 3, 4] | reject('even') | list }} {{ ['a', 'B'] | map('upper') | list }} {{ users | map(attribute='nick', default='-') | list }} {{ users | selectattr('nick', 'defined') | list | length }}", {"users": [{"name": "ann", "admin": True, "age": 40}, {"name": "bob", "admin": False, "age": 20}]}),
    ("string_methods", "{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a b c'.split(' ', 1) }} {{ 'a-b-c'.rsplit('-', 1) }} {{ 'xhix'.strip('x') }} {{ '  y'.lstrip() }} {{ 'z \\n'.rstrip() }} {{ 'abc'.startswith('ab') }} {{ 'abc'.endswith(('x', 'c')) }} {{ 'aXa'.replace('a', 'b') }} {{ 'hi there'.title() }} {{ 'Hi'.upper() }}{{ 'Hi'.lower() }} {{ 'abcb'.find('b') }} {{ 'abcb'.count('b') }} {{ '-'.join(['x', 'y']) }} {{ 'l1\\nl2'.splitlines() }} {{ '123'.isdigit() }}", {}),
    ("string_index_slice", "{{ s[0] }}{{ s[-1] }}|{{ s[1:3] }}|{{ s[::-1] }}|{{ s[:-1] }}|{{ s | length }}|{{ xs[1:] }}|{{ xs[::2] }}|{{ xs[-2:] }}|{{ xs[5] is defined }}", {"s": "héllo✓", "xs": [1, 2, 3, 4]}),
    ("dict_methods", "{{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', 'dflt') }} {{ d.keys() | list }} {{ d.values() | list }} {{ d.items() | list }} {{ d['a'] }} {{ d.a }}", {"d": {"a": 1, "b": [2]}}),
    ("dict_literal_and_dict_global", "{% set d = {'x': 1, 'y': {'z': 2}} %}{{ d.y.z }} {{ dict(a=1, b=2) }} {{ d | tojson }}", {}),
    ("raise_exception", "{% if true %}{{ raise_exception('bad input: ' ~ 3) }}{% endif %}", {}),
    ("attribute_int_index", "{{ xs.0 }} {{ xs.1.name }}", {"xs": ["a", {"name": "n"}]}),
    ("unicode_passthrough", "{{ s }}|{{ s | upper }}|{{ s | length }}", {"s": "naïve 日本 🎉"}),
    ("filter_precedence", "{{ xs | length - 1 }} {{ -xs | length if false else 'ok' }} {{ not xs | length }} {{ 'ab' ~ 'cd' | upper }}", {"xs": [1, 2]}),
    ("sandbox_mutation_fails", "{% set xs = [1] %}{{ xs.append(2) }}", {}),
    ("strict_compare_fails", "{{ 1 < 'a' }}", {}),
    ("lstrip_only_whole_line", "a {% if true %}b{% endif %}\n  x {% if true %}y{% endif %}\n\t{% if true %}\nz{% endif %}", {}),
    ("variable_tags_not_lstripped", "a\n    {{ 'v' }}\n  {{- 'w' }}\n", {}),
    ("minus_trims_newlines", "a\n\n  {%- if true -%}\n\n  b  \n{%- endif %}\nc", {}),
    ("raw_with_whitespace_control", "x  {%- raw -%}  {{ y }}  {%- endraw -%}  z", {}),
    ("trailing_newline_dropped", "line\n", {}),
]


def deepseek_raw_cases():
    """The DeepSeek-V3 template's tool-call branch needs `content: None`, which transformers 5 strips before
    rendering; render it without that normalization so the branch is still checked against jinja2."""
    with open(os.path.join(DATA, "deepseek-v3", "tokenizer_config.json"), encoding="utf-8") as f:
        source = json.load(f)["chat_template"]
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "content": "rain"},
        {"role": "tool", "content": "sun"},
        {"role": "assistant", "content": "Rain in Paris, sun in Rome."},
        {"role": "user", "content": "Thanks"},
    ]
    variables = {"messages": messages, "bos_token": "<｜begin▁of▁sentence｜>", "add_generation_prompt": True}
    return [("deepseek_raw_tool_calls", source, variables)]


def render_jinja_cases():
    out = []
    for name, source, variables in JINJA_CASES + deepseek_raw_cases():
        case = {"name": name, "template": source, "variables": variables}
        try:
            case["expected"] = _compile_jinja_template(source).render(**variables)
        except Exception as e:  # noqa: BLE001
            case["error"] = f"{type(e).__name__}: {e}"
        out.append(case)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "tests", "tokenizer", "chat_fixtures"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    harmony_path = os.path.join(ROOT, "templates", "harmony.jinja")
    with open(harmony_path, encoding="utf-8") as f:
        harmony = f.read()
    suites = [
        # (file, model dir under ../shared/data/tokenizers, template file relative to the repo or None, flavor, extra kwargs)
        ("qwen3", "qwen3", None, "qwen", {}),
        ("deepseek-v3", "deepseek-v3", None, "deepseek", {}),
        ("harmony", "gpt-oss", "templates/harmony.jinja", "harmony", {"current_date": "2025-06-28"}),
    ]
    for file_name, model, template_file, flavor, defaults in suites:
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(DATA, model))
        template = harmony if template_file else None
        cases = [(n, m, {**defaults, **kw}) for n, m, kw in conversations(flavor)]
        if flavor == "harmony":
            cases.append(("harmony_reasoning_high", [{"role": "developer", "content": "Answer in riddles."}, {"role": "user", "content": "Hi"}],
                          {**defaults, "reasoning_effort": "high", "knowledge_cutoff": "2024-06", "add_generation_prompt": True}))
            cases.append(("harmony_bad_role", [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}], defaults))
        rendered = render_model(tokenizer, template, cases)
        doc = {"generator": "tools/make_chat_fixtures.py", "model_dir": f"../shared/data/tokenizers/{model}",
               "template_file": template_file, "cases": rendered}
        path = os.path.join(args.out, f"{file_name}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, ensure_ascii=False)
            f.write("\n")
        errors = sum("error" in c for c in rendered)
        print(f"{path}: {len(rendered)} cases ({errors} expected errors)")
    jinja_cases = render_jinja_cases()
    path = os.path.join(args.out, "jinja.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"generator": "tools/make_chat_fixtures.py", "cases": jinja_cases}, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"{path}: {len(jinja_cases)} cases ({sum('error' in c for c in jinja_cases)} expected errors)")


if __name__ == "__main__":
    sys.exit(main())
