// A tiny extension for tests/inference/test_cpp_extensions.py: it builds through the same CppExtension path as
// the real kernels, in about a second (the bare Python C API: torch/extension.h or pybind11 take 15-30 s).
#include <Python.h>

#include "tiny_value.h"

#define TINY_CONCAT2(a, b) a##b
#define TINY_CONCAT(a, b) TINY_CONCAT2(a, b)
#define TINY_STR2(a) #a
#define TINY_STR(a) TINY_STR2(a)

static PyObject* value(PyObject*, PyObject*) { return PyLong_FromLong(TINY_VALUE); }

static PyMethodDef methods[] = {{"value", value, METH_NOARGS, "TINY_VALUE"}, {nullptr, nullptr, 0, nullptr}};

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, TINY_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};

PyMODINIT_FUNC TINY_CONCAT(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&module_def); }
