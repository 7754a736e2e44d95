"""A command-line front end to the cvc5 Python package, behaving like the cvc5 binary.

    python -m tvsmt.solving.cvc5_shim [--opt[=value] ...] FILE     run a script file
    python -m tvsmt.solving.cvc5_shim [--opt[=value] ...] [-]      read commands on stdin
    python -m tvsmt.solving.cvc5_shim --version

PyPI ships cvc5 only as a Python package (no binary); this module lets the runner treat it like
any external solver: its own process, killed from outside on timeout. Scripts are parsed by
cvc5's own SMT-LIB parser (InputParser + SymbolManager); each answer is printed as the binary
prints it (`sat`, `((x (/ (- 1) 4)))`, `(error "...")`) and flushed at once.

Options `--name=value` / `--name` (= true) are passed to `Solver.setOption`; `--lang=smt2` is
accepted and ignored (only SMT-LIB 2.6 is read). In file mode the first error stops the run
with exit code 1; on stdin, errors are printed and reading goes on (as `z3 -in` does), and
`(reset)` starts over with a fresh solver. Keep this module free of tvsmt imports: it is
started once per solver process.
"""

from __future__ import annotations

import sys


def _parse_args(argv: list[str]):
    options: list[tuple[str, str]] = []
    files: list[str] = []
    version = False
    for arg in argv:
        if arg in ("--version", "-V"):
            version = True
        elif arg.startswith("--") and len(arg) > 2:
            name, _, value = arg[2:].partition("=")
            if name == "lang":
                if value not in ("smt2", "smt2.6", "smtlib2.6", "smt"):
                    raise SystemExit(f"cvc5_shim: unsupported --lang={value} (only smt2)")
                continue
            options.append((name, value if "=" in arg else "true"))
        elif arg in ("-q", "--quiet"):
            continue
        elif arg.startswith("-") and arg != "-":
            raise SystemExit(f"cvc5_shim: unknown argument {arg}")
        else:
            files.append(arg)
    if len(files) > 1:
        raise SystemExit("cvc5_shim: at most one input file")
    return options, (files[0] if files else "-"), version


def _quote(msg: str) -> str:
    return '"' + msg.replace('"', '""') + '"'


class _Session:
    """A solver + symbol manager; each top-level command is parsed and run on its own."""

    def __init__(self, cvc5, options, out):
        self.cvc5, self.options, self.out = cvc5, options, out
        self.lang = cvc5.InputLanguage.SMT_LIB_2_6
        self.fresh()

    def fresh(self) -> None:
        cvc5 = self.cvc5
        self.tm = cvc5.TermManager()
        self.solver = cvc5.Solver(self.tm)
        for name, value in self.options:
            self.solver.setOption(name, value)
        self.sm = cvc5.SymbolManager(self.tm)

    def run(self, text: str, name: str = "stdin") -> str | None:
        """Run the commands of `text`; "exit" after `(exit)`, "error" after an error."""
        if "(reset" in text or "(exit" in text:
            # `(reset)` needs a new solver for the commands after it: run one by one.
            pieces = _split_commands(text)
            if len(pieces) > 1:
                for piece in pieces:
                    status = self.run(piece, name)
                    if status:
                        return status
                return None
        try:
            parser = self.cvc5.InputParser(self.solver, self.sm)
            parser.setStringInput(self.lang, text, name)
            while True:
                cmd = parser.nextCommand()
                if cmd.isNull():
                    return None
                kind = cmd.getCommandName()
                if kind == "exit":
                    return "exit"
                if kind == "reset":
                    self.fresh()
                    continue
                answer = cmd.invoke(self.solver, self.sm)
                if answer:
                    self.out.write(answer)
                    self.out.flush()
                    if answer.startswith("(error"):  # e.g. get-value without a model
                        return "error"
        except Exception as e:  # cvc5 raises RuntimeError for parse and solver errors
            msg = " ".join(str(e).split()) or type(e).__name__
            self.out.write(f"(error {_quote(msg)})\n")
            self.out.flush()
            return "error"


def _split_commands(text: str) -> list[str]:
    """Top-level commands of `text` (strings, |symbols| and comments respected)."""
    out, depth, start, i, n = [], 0, None, 0, len(text)
    while i < n:
        c = text[i]
        if c == ";":
            j = text.find("\n", i)
            i = n if j < 0 else j + 1
            continue
        if c == '"':
            j = i + 1
            while True:
                j = text.find('"', j)
                if j < 0 or j + 1 >= n or text[j + 1] != '"':
                    break
                j += 2
            i = n if j < 0 else j + 1
            continue
        if c == "|":
            j = text.find("|", i + 1)
            i = n if j < 0 else j + 1
            continue
        if c == "(":
            if depth == 0:
                start = i
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0 and start is not None:
                out.append(text[start:i + 1])
                start = None
        i += 1
    if start is not None:
        out.append(text[start:])  # unbalanced tail: let the parser report it
    return out


class _Balance:
    """Tracks the parenthesis depth of a stream fed line by line."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.in_symbol = False

    def feed(self, line: str) -> None:
        if not (self.in_string or self.in_symbol) and not any(c in line for c in '";|'):
            self.depth += line.count("(") - line.count(")")
            return
        i, n = 0, len(line)
        while i < n:
            c = line[i]
            if self.in_string:
                if c == '"':
                    if i + 1 < n and line[i + 1] == '"':
                        i += 1
                    else:
                        self.in_string = False
            elif self.in_symbol:
                if c == "|":
                    self.in_symbol = False
            elif c == ";":
                break
            elif c == '"':
                self.in_string = True
            elif c == "|":
                self.in_symbol = True
            elif c == "(":
                self.depth += 1
            elif c == ")":
                self.depth -= 1
            i += 1

    @property
    def complete(self) -> bool:
        return self.depth <= 0 and not self.in_string and not self.in_symbol


def _stdin_loop(session: _Session) -> int:
    bal, chunk = _Balance(), []
    stdin = sys.stdin.buffer
    while True:
        raw = stdin.readline()
        if not raw:
            break
        line = raw.decode("utf-8", errors="replace")
        chunk.append(line)
        bal.feed(line)
        if bal.complete:
            text = "".join(chunk)
            chunk, bal = [], _Balance()
            if text.strip() and session.run(text) == "exit":
                return 0
    if "".join(chunk).strip():
        session.run("".join(chunk))
    return 0


def main(argv: list[str] | None = None) -> int:
    options, source, version = _parse_args(sys.argv[1:] if argv is None else argv)
    import cvc5  # after argument parsing: `--help`-like mistakes stay fast

    out = sys.stdout
    if version:
        v = cvc5.Solver(cvc5.TermManager()).getVersion()
        v = v.decode() if isinstance(v, bytes) else str(v)
        out.write(f"This is cvc5 version {v} (Python package, tvsmt shim)\n")
        return 0
    try:
        session = _Session(cvc5, options, out)
    except Exception as e:
        out.write(f"(error {_quote(' '.join(str(e).split()))})\n")
        return 1
    if source == "-":
        return _stdin_loop(session)
    try:
        with open(source, "rb") as fh:
            text = fh.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        out.write(f"(error {_quote(f'cannot read {source}: {e}')})\n")
        return 1
    return 1 if session.run(text, source) == "error" else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(1)
