// Note [One table per enum]: an enum's names are one constexpr table beside it, read both
// ways: to_string (name_of) and the parsers (value_of). Before, eight enums spelled each
// name twice (a switch and a chain of ifs) in eight files' own ways.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string_view>
#include <utility>

#include "spillway/core/error.hpp"

namespace spillway {

template <typename E, size_t N>
using EnumNames = std::array<std::pair<E, std::string_view>, N>;

// The name of `v` (a literal: null-terminated, so .data() is a C string); a value the table
// lacks is a bug, said as one.
template <typename E, size_t N>
std::string_view name_of(const EnumNames<E, N>& table, E v) {
  for (const auto& [e, n] : table)
    if (e == v) return n;
  SPILLWAY_CHECK(false, "enum value {} has no name", static_cast<int>(v));
}

// The value named `name`, or nullopt (the caller says what the field accepts).
template <typename E, size_t N>
std::optional<E> value_of(const EnumNames<E, N>& table, std::string_view name) {
  for (const auto& [e, n] : table)
    if (n == name) return e;
  return std::nullopt;
}

}  // namespace spillway
