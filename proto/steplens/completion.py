"""Shell completion scripts (bash, zsh, fish) generated from an argparse parser at run time, so they list the
subcommands and options the program has now and cannot go stale.

`spec(parser)` walks the parser once (argparse's `_actions` and each subparsers action's `choices`) into one
`Node` per subcommand path ("", "import", "import flows"); each shell's script embeds those nodes as data and
one small walker: it follows the words typed so far through the subcommands, skipping options and their values,
then offers the node's subcommands, its options (after `-`), an option's choices, or file names. An argument
completes file names when its dest or metavar names a file (FILE_NAME below: file, output, path, dir, config,
and TLS ca/cert/key); positionals without choices and options with a free value (a job key, a duration) offer
nothing. Costs one walk of the parser; no dependency (argcomplete is not used).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

FILE_NAME = re.compile(r"(^|_)(file|output|path|dir|config|db|ca|cert|key)$", re.I)


@dataclass
class Option:
    flags: list[str]
    help: str
    takes_value: bool   # the next word is its value (nargs "?" does not count: `--watch --json` is two flags)
    choices: list[str] | None
    files: bool


@dataclass
class Node:
    path: str
    subs: list[tuple[str, str]] = field(default_factory=list)   # (name, help)
    options: list[Option] = field(default_factory=list)
    positionals: list[tuple[list[str] | None, bool]] = field(default_factory=list)   # (choices, files)


def _files(action: argparse.Action) -> bool:
    return bool(FILE_NAME.search(action.dest or "") or FILE_NAME.search(str(action.metavar or "")))


def _help(action) -> str:
    text = action.help if action.help and action.help != argparse.SUPPRESS else ""
    return " ".join(text.split())


def spec(parser: argparse.ArgumentParser, path: str = "") -> dict[str, Node]:
    """Every subcommand path of the parser -> its Node (the root is "")."""
    node, out = Node(path), {}
    out[path] = node
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: _help(a) for a in action._choices_actions}
            for name, sub in action.choices.items():
                node.subs.append((name, helps.get(name, "")))
                out.update(spec(sub, f"{path} {name}".strip()))
        elif action.option_strings:
            if action.help == argparse.SUPPRESS:
                continue
            takes = action.nargs not in (0, "?")
            node.options.append(Option(list(action.option_strings), _help(action), takes,
                                       [str(c) for c in action.choices] if action.choices else None,
                                       takes and _files(action)))
        else:
            node.positionals.append(([str(c) for c in action.choices] if action.choices else None, _files(action)))
    return out


def _sq(text: str) -> str:
    """text as one single-quoted word for bash and zsh."""
    return "'" + text.replace("'", "'\\''") + "'"


def _fq(text: str) -> str:
    """text as one single-quoted word for fish, where \\ and \\' are escapes inside single quotes."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _values(node: Node) -> list[tuple[str, str]]:
    """(key, what completes it): key an option flag or '#N' (the Nth positional); what '@files' or choices."""
    out = []
    for o in node.options:
        if o.takes_value and (o.files or o.choices):
            out += [(f, "@files" if o.files else " ".join(o.choices)) for f in o.flags]
    for i, (choices, files) in enumerate(node.positionals, 1):
        if files or choices:
            out.append((f"#{i}", "@files" if files else " ".join(choices)))
    return out


def _case_tables(nodes: dict[str, Node], prog: str) -> str:
    """Two functions in the syntax bash and zsh share: <fn>_node PATH sets subs, opts and vopts (the options
    that take a value) of that subcommand path; <fn>_values PATH KEY sets vals to what completes that option's
    value or positional ('@files', or words)."""
    fn = _fn(prog)
    node_case, value_case = [], []
    for path, n in nodes.items():
        node_case.append(f"        {_sq(path)}) subs={_sq(' '.join(s for s, _ in n.subs))}; "
                         f"opts={_sq(' '.join(f for o in n.options for f in o.flags))}; "
                         f"vopts={_sq(' '.join(f for o in n.options if o.takes_value for f in o.flags))};;")
        value_case += [f"        {_sq(f'{path}|{key}')}) vals={_sq(what)};;" for key, what in _values(n)]
    return (f"{fn}_node() {{\n    subs='' opts='' vopts=''\n    case \"$1\" in\n" + "\n".join(node_case) +
            f"\n    esac\n}}\n\n{fn}_values() {{\n    vals=''\n    case \"$1|$2\" in\n" + "\n".join(value_case) +
            "\n    esac\n}\n")


def _fn(prog: str) -> str:
    return "_" + re.sub(r"\W", "_", prog)


def bash(parser: argparse.ArgumentParser, prog: str) -> str:
    fn = _fn(prog)
    return f"""# bash completion for {prog}, generated from its argument parser by `{prog} completion bash`.
# Use: eval "$({prog} completion bash)" in ~/.bashrc, or save it as
# ~/.local/share/bash-completion/completions/{prog}

{_case_tables(spec(parser), prog)}
{fn}() {{
    local cur=${{COMP_WORDS[COMP_CWORD]}} cmdpath='' npos=0 i w want='' glue=0 subs opts vopts vals
    COMPREPLY=()
    [[ $cur == : ]] && return
    [[ $cur == = ]] && cur=''
    {fn}_node ''
    for ((i = 1; i < COMP_CWORD; i++)); do
        w=${{COMP_WORDS[i]}}
        # bash splits --opt=value and host:port at = and : (COMP_WORDBREAKS): glue the pieces back together
        if [[ $w == = ]]; then continue; fi
        if [[ $w == : ]]; then glue=1; continue; fi
        if ((glue)); then glue=0; continue; fi
        if [[ -n $want ]]; then want=''; continue; fi
        case $w in
            --*=*) ;;
            -*) [[ " $vopts " == *" $w "* ]] && want=$w ;;
            *) if [[ " $subs " == *" $w "* ]]; then
                   cmdpath=${{cmdpath:+$cmdpath }}$w; npos=0; {fn}_node "$cmdpath"
               else
                   ((npos++))
               fi ;;
        esac
    done
    ((glue)) && return
    if [[ -n $want ]]; then
        {fn}_values "$cmdpath" "$want"
    elif [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur")); return
    elif [[ -n $subs ]]; then
        COMPREPLY=($(compgen -W "$subs" -- "$cur")); return
    else
        {fn}_values "$cmdpath" "#$((npos + 1))"
    fi
    if [[ $vals == @files ]]; then
        compopt -o filenames 2>/dev/null
        COMPREPLY=($(compgen -f -- "$cur"))
    elif [[ -n $vals ]]; then
        COMPREPLY=($(compgen -W "$vals" -- "$cur"))
    elif [[ -z $want ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))   # nothing else to offer here: the options
    fi
}}
complete -F {fn} {prog}
"""


def zsh(parser: argparse.ArgumentParser, prog: str) -> str:
    fn = _fn(prog)
    nodes = spec(parser)
    desc = []
    for path, n in nodes.items():  # _describe reads NAME:DESCRIPTION
        items = [(s, h) for s, h in n.subs] + [(f, o.help) for o in n.options for f in o.flags]
        desc.append(f"        {_sq(path)}) described=(" +
                    " ".join(_sq(x.replace(":", "\\:") + ":" + h) for x, h in items) + ");;")
    return f"""#compdef {prog}
# zsh completion for {prog}, generated from its argument parser by `{prog} completion zsh`.
# Use: source <({prog} completion zsh) in ~/.zshrc (after compinit), or save it as _{prog} in a $fpath directory

{_case_tables(nodes, prog)}
{fn}_described() {{
    described=()
    case "$1" in
{chr(10).join(desc)}
    esac
}}

{fn}() {{
    local cur=${{words[CURRENT]}} cmdpath='' npos=0 i w want='' subs opts vopts vals
    local -a described picked
    {fn}_node ''
    for ((i = 2; i < CURRENT; i++)); do
        w=${{words[i]}}
        if [[ -n $want ]]; then want=''; continue; fi
        case $w in
            --*=*) ;;
            -*) [[ " $vopts " == *" $w "* ]] && want=$w ;;
            *) if [[ " $subs " == *" $w "* ]]; then
                   cmdpath=${{cmdpath:+$cmdpath }}$w; npos=0; {fn}_node "$cmdpath"
               else
                   ((npos++))
               fi ;;
        esac
    done
    if [[ -z $want && $cur == --*=* ]]; then   # --opt=value: complete the value after the =
        want=${{cur%%=*}}; compset -P '*='
    fi
    if [[ -n $want ]]; then
        {fn}_values "$cmdpath" "$want"
    elif [[ $cur == -* || -n $subs ]]; then
        {fn}_described "$cmdpath"
        if [[ $cur == -* ]]; then picked=(${{(M)described:#-*}}); else picked=(${{described:#-*}}); fi
        _describe -t commands {prog} picked
        return
    else
        {fn}_values "$cmdpath" "#$((npos + 1))"
    fi
    if [[ $vals == @files ]]; then
        _files
    elif [[ -n $vals ]]; then
        compadd -- ${{=vals}}
    fi
}}

if [[ $zsh_eval_context[-1] == loadautofunc ]]; then
    {fn} "$@"
else
    compdef {fn} {prog}
fi
"""


def fish(parser: argparse.ArgumentParser, prog: str) -> str:
    fn = "_" + _fn(prog)
    nodes = spec(parser)
    subs_case = "\n".join(f"        case {_fq(p)}\n            echo {_fq(' '.join(s for s, _ in n.subs))}"
                          for p, n in nodes.items() if n.subs)
    vopts_case = "\n".join(f"        case {_fq(p)}\n            echo "
                           f"{_fq(' '.join(f for o in n.options if o.takes_value for f in o.flags))}"
                           for p, n in nodes.items() if any(o.takes_value for o in n.options))
    lines = [f"complete -c {prog} -f"]
    for path, n in nodes.items():
        at = f"-n {_fq(f'{fn}_at {_fq(path)}')}"
        for name, h in n.subs:
            lines.append(f"complete -c {prog} {at} -a {_fq(name)} -d {_fq(h)}")
        for o in n.options:
            flags = " ".join(f"-l {f[2:]}" if f.startswith("--") else f"-s {f[1:]}" for f in o.flags)
            what = ""
            if o.takes_value:
                what = " -r -F" if o.files else f" -x -a {_fq(' '.join(o.choices))}" if o.choices else " -x"
            lines.append(f"complete -c {prog} {at} {flags}{what} -d {_fq(o.help)}")
        for i, (choices, files) in enumerate(n.positionals, 1):
            if choices or files:
                cond = f"-n {_fq(f'{fn}_at {_fq(path)} {i}')}"
                lines.append(f"complete -c {prog} {cond} -F" if files else
                             f"complete -c {prog} {cond} -a {_fq(' '.join(choices))}")
    return f"""# fish completion for {prog}, generated from its argument parser by `{prog} completion fish`.
# Use: {prog} completion fish > ~/.config/fish/completions/{prog}.fish

function {fn}_subs
    switch $argv[1]
{subs_case}
    end
end

function {fn}_vopts
    switch $argv[1]
{vopts_case}
    end
end

# {fn}_at PATH [N]: the words before the cursor lead to subcommand PATH (with N: and the word at the cursor is
# PATH's Nth positional, not an option's value)
function {fn}_at
    set -l cmdpath ''
    set -l npos 0
    set -l want 0
    for w in (commandline -opc)[2..-1]
        if test $want = 1
            set want 0
            continue
        end
        switch $w
            case '--*=*'
            case '-*'
                contains -- $w (string split ' ' -- ({fn}_vopts $cmdpath)); and set want 1
            case '*'
                if contains -- $w (string split ' ' -- ({fn}_subs $cmdpath))
                    set cmdpath (string trim -- "$cmdpath $w")
                    set npos 0
                else
                    set npos (math $npos + 1)
                end
        end
    end
    test "$cmdpath" = "$argv[1]"; or return 1
    test (count $argv) -lt 2; or begin; test $want = 0; and test (math $npos + 1) = $argv[2]; end
end

{chr(10).join(lines)}
"""


SHELLS = {"bash": bash, "zsh": zsh, "fish": fish}


def script(parser: argparse.ArgumentParser, shell: str, prog: str | None = None) -> str:
    """The completion script for shell ('bash', 'zsh' or 'fish') of the program the parser parses."""
    return SHELLS[shell](parser, prog or parser.prog)
