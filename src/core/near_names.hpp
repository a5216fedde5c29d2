// "Did you mean": the names of a list closest to one that matched none, for the messages
// of the catalog lookups (models, hardware profiles). Case is ignored throughout.
#pragma once

#include <algorithm>
#include <cctype>
#include <string>
#include <string_view>
#include <vector>

namespace spillway {

inline std::string lower_ascii(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

// Levenshtein distance (insertions, deletions, substitutions), case ignored.
inline size_t edit_distance(std::string_view a_in, std::string_view b_in) {
  const std::string a = lower_ascii(a_in);
  const std::string b = lower_ascii(b_in);
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// The names `given` most likely meant: those it begins (h100 -> h100-pcie, h100-sxm), else
// those within a few edits (Lama-3.1-8B -> Llama-3.1-8B). Empty when none is close.
inline std::vector<std::string> near_names(std::string_view given,
                                           const std::vector<std::string>& names) {
  std::vector<std::string> out;
  const std::string g = lower_ascii(given);
  if (g.empty()) return out;
  for (const std::string& n : names)
    if (lower_ascii(n).starts_with(g)) out.push_back(n);
  if (!out.empty()) return out;
  const size_t limit = std::max<size_t>(2, g.size() / 4);
  size_t best = limit + 1;
  for (const std::string& n : names) {
    const size_t d = edit_distance(g, n);
    if (d < best) {
      best = d;
      out.clear();
    }
    if (d == best) out.push_back(n);
  }
  return out;
}

// " Did you mean A or B?" (empty when nothing is close).
inline std::string did_you_mean(std::string_view given, const std::vector<std::string>& names) {
  const std::vector<std::string> near = near_names(given, names);
  if (near.empty()) return {};
  std::string s = " Did you mean ";
  for (size_t i = 0; i < near.size(); ++i)
    s += (i == 0 ? "" : i + 1 == near.size() ? " or " : ", ") + near[i];
  return s + "?";
}

}  // namespace spillway
