// Note [Every numeric flag has a range]
// A numeric flag without a range accepts values with no physical meaning and prints absurd
// figures (a bandwidth of 1e-300 GB/s gives a 300-digit step time) or silently means
// something else (0 GPUs meant the default). So every numeric flag of every subcommand
// goes through in_range: its --help ends with the range in one notation, " [lo, hi]",
// " (lo, hi]" (lo excluded) or " [lo, hi] or S" (one sentinel with its own meaning, said
// in the text: "0: none"), and a value outside is refused before anything runs. An upper
// bound that depends on the input ("[1, the model's layers]") is stated in words and
// checked by the library once the input is known. The library checks its own limits too
// (PlanLimits, the options' validation) for callers that do not come through the CLI; the
// CLI states them where the user reads them, from the same constants.
// `CliRanges.EveryNumericFlagStatesAndEnforcesItsRange` reads every subcommand's --help
// back and tries a value below and above each stated range.
#include "tool/ranges.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>

#include "spillway/core/error.hpp"

namespace spillway::tool {

std::string range_text(const FlagRange& r) {
  std::string s = fmt::format(" {}{}, ", r.lo_open ? '(' : '[', r.lo);
  s += r.hi_text.empty() ? fmt::format("{}", r.hi) : r.hi_text;
  s += ']';
  if (r.also) s += fmt::format(" or {}", *r.also);
  return s;
}

CLI::Option* in_range(CLI::Option* opt, const FlagRange& r) {
  opt->description(opt->get_description() + range_text(r));
  // The long name even for an option hidden from --help (whose get_name() is empty).
  const std::string name =
      opt->get_lnames().empty() ? opt->get_name() : "--" + opt->get_lnames().front();
  // CLI11 would say only "Could not convert" for 1e3 or "x" given to an integer flag.
  const std::string type = opt->get_type_name();
  const bool integer = type == "INT" || type == "UINT";
  opt->check(CLI::Validator(
      [r, name, integer](std::string& text) -> std::string {
        const char* begin = text.c_str();
        char* end = nullptr;
        const double v = std::strtod(begin, &end);
        // Not a number of the flag's kind: a usage error (exit 2, CLI11 prefixes the flag);
        // a number outside the range is an input error (exit 1), as the library's own.
        if (end == begin || *end != '\0') {
          return fmt::format("{} is not {}", text, integer ? "an integer" : "a number");
        }
        if (integer && text.find_first_not_of("+-0123456789") != std::string::npos) {
          return fmt::format("{} is not an integer written in digits{}", text,
                             std::isfinite(v) && v == std::floor(v)
                                 ? fmt::format(" ({:.0f}, not {})", v, text)
                                 : std::string());
        }
        if (r.also && v == *r.also) return {};
        const bool below = r.lo_open ? !(v > r.lo) : !(v >= r.lo);
        const bool above = r.hi_text.empty() && !(v <= r.hi);
        if (below || above || std::isnan(v)) {
          std::string rule = "must be in" + range_text(r);
          throw InputError(name, text, rule);
        }
        return {};
      },
      "", "range"));
  return opt;
}

}  // namespace spillway::tool
