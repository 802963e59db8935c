#!/usr/bin/env python3
"""Rejects an #include that points up corpc's layer table.

The table is the one in docs/ARCHITECTURE.md ("## Layers"): a row per layer, its name in backticks in the first
cell, the libraries beyond the C++ and POSIX ones that it uses, in backticks, in the next to last ("uses"), and the
layers it builds on, in backticks, in the last. A file in include/corpc/<L>/ or src/<L>/ may include
  - the public headers of L and of every layer L builds on, directly or through another ("corpc/<M>/..."),
  - the private headers of those layers ("<M>/name.hpp", from src/<M>/),
  - corpc/detail/ (the libtorch release shims, shared by every layer that sees libtorch),
  - the headers of the libraries L uses (LIBRARIES below says which headers are whose; any other <header> is the
    C++ library's or the system's),
and a public header never includes a private one. It also holds docs/ARCHITECTURE.md to "the environment is read in
src/rpc/environment.cpp": a getenv in any other file of src/ or include/ is rejected, but for the two readers with
protocols of their own (ENVIRONMENT_READERS). Run by the build before anything compiles (meson.build) and by
the tests (tests/meson.build, with --self-test showing that it rejects an upward include).

  check_layers.py ROOT [--stamp FILE]    check the tree at ROOT; on success write FILE (the build's stamp)
  check_layers.py --self-test            check a small made-up tree with one upward include: it must be rejected
"""
import os
import re
import sys
import tempfile

ROW = re.compile(r'^\|\s*`(\w+)`\s*\|.*\|([^|]*)\|([^|]*)\|\s*$')
INCLUDE = re.compile(r"^[ \t]*#\s*include\s+\"([^\"]+)\"", re.M)
SYSTEM_INCLUDE = re.compile(r"^[ \t]*#\s*include\s+<([^>]+)>", re.M)
# Whose header an #include <...> names: the libraries a layer may list under "uses".
LIBRARIES = {
    'asio': re.compile(r'^asio(\.hpp$|/)'),
    'libtorch': re.compile(r'^(ATen|c10|torch|caffe2)/'),
    'gloo': re.compile(r'^gloo/'),
    'openssl': re.compile(r'^openssl/'),
    'fmt': re.compile(r'^fmt/'),
    'cuda': re.compile(r'^(cuda|cuda_runtime|cuda_runtime_api|driver_types)\.h$'),
    'doctest': re.compile(r'^doctest/'),
}
# The files that may read the environment: the runtime's settings, logging (which exists before any runtime) and the
# variables between launch_processes and the ranks it starts.
ENVIRONMENT_READERS = {'src/rpc/environment.cpp', 'src/core/log.cpp', 'src/rpc/launch_protocol.cpp'}
GETENV = re.compile(r'\b(secure_)?getenv\s*\(')


def read_table(root):
    path = os.path.join(root, 'docs', 'ARCHITECTURE.md')
    table, uses, inside = {}, {}, False
    for line in open(path, encoding='utf-8'):
        if line.startswith('## '):
            inside = line.strip() == '## Layers'
            continue
        m = ROW.match(line) if inside else None
        if m:
            table[m.group(1)] = re.findall(r'`(\w+)`', m.group(3))
            uses[m.group(1)] = set(re.findall(r'`(\w+)`', m.group(2)))
    if not table:
        sys.exit(f'{path}: no layer table under "## Layers"')
    for layer, below in table.items():
        for b in below:
            if b not in table:
                sys.exit(f'{path}: layer {layer} builds on {b}, which has no row')
        for lib in uses[layer] - set(LIBRARIES):
            sys.exit(f'{path}: layer {layer} uses {lib}, which tools/check_layers.py does not know')
    return table, uses


def closure(table):
    reach = {}

    def visit(layer, path):
        if layer in path:
            sys.exit('docs/ARCHITECTURE.md: the layer table has a cycle: ' + ' -> '.join(path + [layer]))
        if layer not in reach:
            below = set()
            for b in table[layer]:
                below |= {b} | visit(b, path + [layer])
            reach[layer] = below
        return reach[layer]

    for layer in table:
        visit(layer, [])
    return reach


def files_of(root, table):
    for kind, base in (('public', os.path.join(root, 'include', 'corpc')), ('private', os.path.join(root, 'src'))):
        for layer in table:
            folder = os.path.join(base, layer)
            for dirpath, _, names in os.walk(folder):
                for name in sorted(names):
                    if name.endswith(('.hpp', '.cpp', '.h')):
                        yield kind, layer, os.path.join(dirpath, name)


def check(root):
    table, uses = read_table(root)
    reach = closure(table)
    errors = []
    for kind, layer, path in files_of(root, table):
        rel = os.path.relpath(path, root)
        text = open(path, encoding='utf-8').read()
        if rel not in ENVIRONMENT_READERS:
            for m in GETENV.finditer(text):
                line = text.count('\n', 0, m.start()) + 1
                errors.append(f'{rel}:{line}: reads the environment outside src/rpc/environment.cpp (add a function '
                              f'there; docs/ARCHITECTURE.md)')
        for m in SYSTEM_INCLUDE.finditer(text):
            inc = m.group(1)
            lib = next((name for name, pattern in LIBRARIES.items() if pattern.search(inc)), None)
            if lib and lib not in uses[layer]:
                line = text.count('\n', 0, m.start()) + 1
                errors.append(f'{rel}:{line}: #include <{inc}>: {layer} does not use {lib} '
                              f'(it uses {", ".join(sorted(uses[layer])) or "the C++ and system libraries only"}; '
                              f'docs/ARCHITECTURE.md, "Layers")')
        for m in INCLUDE.finditer(text):
            inc = m.group(1)
            line = text.count('\n', 0, m.start()) + 1
            parts = inc.split('/')
            if parts[0] == 'corpc' and len(parts) == 2:
                target, private = None, False  # the umbrella header: nothing inside a layer may include it
            elif parts[0] == 'corpc' and parts[1] == 'detail':
                continue
            elif parts[0] == 'corpc':
                target, private = parts[1], False
            elif len(parts) == 1:
                # Beside the including file: the same layer's header (a private source's own header).
                if os.path.exists(os.path.join(os.path.dirname(path), inc)):
                    continue
                target, private = None, True
            elif parts[0] in table:
                target, private = parts[0], True
            else:
                target, private = None, True
            where = f'{rel}:{line}: #include "{inc}"'
            if target is None or target not in table:
                errors.append(f'{where}: not a layer\'s header (use "corpc/<layer>/..." or "<layer>/name.hpp")')
            elif private and kind == 'public':
                errors.append(f'{where}: a public header includes a private one (src/{target}/)')
            elif target != layer and target not in reach[layer]:
                builds_on = ', '.join(sorted(reach[layer])) or 'nothing'
                errors.append(f'{where}: {layer} includes {target}, which is not below it '
                              f'({layer} builds on {builds_on}; docs/ARCHITECTURE.md, "Layers")')
    return errors


def self_test():
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, 'docs'))
        with open(os.path.join(root, 'docs', 'ARCHITECTURE.md'), 'w') as f:
            f.write('## Layers\n| layer | where | uses | builds on |\n|---|---|---|---|\n'
                    '| `core` | x | | |\n| `wire` | x | `libtorch` | `core` |\n| `rpc` | x | `asio` | `wire` |\n')
        files = {
            'include/corpc/core/a.hpp': '#include "corpc/core/b.hpp"\n',
            'include/corpc/core/b.hpp': '',
            'include/corpc/rpc/c.hpp': '#include "corpc/core/a.hpp"\n',   # two layers down: allowed
            'src/wire/d.hpp': '',
            'src/rpc/e.cpp': '#include "wire/d.hpp"\n#include "e.hpp"\n',
            'src/rpc/e.hpp': '',
            'src/core/up.cpp': '\n#include "rpc/e.hpp"\n',                # the upward include
            'include/corpc/wire/leak.hpp': '#include "wire/d.hpp"\n',     # public including private
            'src/wire/f.cpp': '#include <ATen/ATen.h>\n#include <vector>\n#include <sys/socket.h>\n',  # its own
            'src/core/g.hpp': '#include <string>\n\n#include <asio.hpp>\n',    # a library core does not use
            'src/rpc/h.cpp': 'int f() { return std::getenv("X") != nullptr; }\n',  # the environment read elsewhere
        }
        for name, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
            with open(os.path.join(root, name), 'w') as f:
                f.write(text)
        errors = check(root)
        want = ['src/core/up.cpp:2: #include "rpc/e.hpp": core includes rpc, which is not below it',
                'include/corpc/wire/leak.hpp:1: #include "wire/d.hpp": a public header includes a private one',
                'src/core/g.hpp:3: #include <asio.hpp>: core does not use asio',
                'src/rpc/h.cpp:1: reads the environment outside src/rpc/environment.cpp']
        missing = [w for w in want if not any(e.startswith(w) for e in errors)]
        if missing or len(errors) != len(want):
            print('self-test failed; errors:', *errors, 'expected:', *want, sep='\n  ')
            return 1
    print('check_layers self-test: the upward include, the public-private include, a library the layer does not use '
          'and an environment read outside environment.cpp are rejected, nothing else')
    return 0


def main(argv):
    if argv[1:] == ['--self-test']:
        return self_test()
    if len(argv) not in (2, 4) or (len(argv) == 4 and argv[2] != '--stamp'):
        print(__doc__, file=sys.stderr)
        return 2
    errors = check(argv[1])
    if errors:
        print('include edges that break the layer table:', *errors, sep='\n  ', file=sys.stderr)
        return 1
    if len(argv) == 4:
        with open(argv[3], 'w') as f:
            f.write('// the include edges of every layer were checked against docs/ARCHITECTURE.md\n')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
