// The reference model's own optimizer (Note [The model's own update], spillway/train/train.hpp).
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "spillway/core/error.hpp"
#include "spillway/train/train.hpp"

namespace spillway::train {

TextbookAdamW::TextbookAdamW(double lr) : lr_(lr) {
  SPILLWAY_CHECK(lr >= 0 && std::isfinite(lr), "TextbookAdamW: lr is {}; must be >= 0", lr);
}

void TextbookAdamW::operator()(const nn::DeviceParameters& p) {
  SPILLWAY_CHECK(p.n == 0 || (p.weights != nullptr && p.moment1 != nullptr &&
                              p.moment2 != nullptr && p.grads != nullptr),
                 "TextbookAdamW: null array for n = {}", p.n);
  ++step_;
  const float b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  const float c1 = 1.0f - std::pow(b1, static_cast<float>(step_));
  const float c2 = 1.0f - std::pow(b2, static_cast<float>(step_));
  const auto a = static_cast<float>(lr_);
  float* w = p.weights;
  float* m = p.moment1;
  float* v = p.moment2;
  const float* g = p.grads;
  for (size_t i = 0; i < p.n; ++i) {
    const float gi = g[i];
    m[i] = b1 * m[i] + (1 - b1) * gi;
    v[i] = b2 * v[i] + (1 - b2) * gi * gi;
    const float mh = m[i] / c1;
    const float vh = v[i] / c2;
    w[i] -= a * (mh / (std::sqrt(vh) + eps) + wd * w[i]);
  }
}

nn::ParameterUpdate TextbookAdamW::update() {
  return [this](const nn::DeviceParameters& p) { (*this)(p); };
}

}  // namespace spillway::train
