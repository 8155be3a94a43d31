"""Monkeypatches of a module-level name in tests/: every `monkeypatch.setattr` / `delattr` call site
(also through `mp` or `quiet`) whose target is a module (resolved by importing it) or a dotted
string, one line each, then the total. Run from a checkout's root:

    python bench/count_patches.py
"""
import ast, pathlib, importlib, sys, types
sys.path.insert(0, 'tests')   # conftest's imports
total=0; rows=[]
for p in sorted(pathlib.Path('tests').rglob('*.py')):
    src=p.read_text(); t=ast.parse(src)
    names={}
    for n in ast.walk(t):
        if isinstance(n, ast.Import):
            for a in n.names: names[a.asname or a.name.split('.')[0]] = a.name if a.asname else a.name.split('.')[0]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level==0:
            for a in n.names:
                names[a.asname or a.name] = f"{n.module}.{a.name}"
    for n in ast.walk(t):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ('setattr','delattr') \
           and isinstance(n.func.value, ast.Name) and n.func.value.id in ('monkeypatch','mp','quiet'):
            if not n.args: continue
            a0=n.args[0]
            if isinstance(a0, ast.Constant) and isinstance(a0.value,str):
                total+=1; rows.append((str(p), n.lineno, a0.value)); continue
            chain=[]; x=a0
            while isinstance(x, ast.Attribute): chain.append(x.attr); x=x.value
            if not isinstance(x, ast.Name) or x.id not in names: continue
            target=names[x.id]
            try:
                obj=importlib.import_module(target)
            except Exception:
                mod, _, attr = target.rpartition('.')
                try: obj=getattr(importlib.import_module(mod), attr)
                except Exception: continue
            for c in reversed(chain):
                obj=getattr(obj, c, None)
            if isinstance(obj, types.ModuleType):
                total+=1; rows.append((str(p), n.lineno, ast.unparse(a0)+"."+(ast.unparse(n.args[1]) if len(n.args)>1 else '')))
for r in rows: print(*r)
print("TOTAL", total)
