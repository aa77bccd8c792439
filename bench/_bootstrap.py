"""Imported first by every benchmark: bench/tokenize.py shares its name with the standard library's `tokenize`, and
Python puts a script's folder first on the import path, where `import tokenize` (inside inspect, numpy, torch)
would find it. Take this folder off the path and put the repo root there instead."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
