// The value tiny_ext.cpp returns: a header, so the tests can see that a header's content is part of the key.
#pragma once
#define TINY_VALUE 42
