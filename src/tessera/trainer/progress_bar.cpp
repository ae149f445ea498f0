#include "tessera/trainer/progress_bar.h"

#include <iostream>

namespace tessera::trainer {

ProgressBar::ProgressBar(ProgressBarOptions o, std::ostream* out) : opt_(std::move(o)), out_(out ? out : &std::cerr) {}
void ProgressBar::start(const std::string&, int64_t, int64_t, int64_t) {}
void ProgressBar::update(int64_t, int64_t, const std::map<std::string, double>&) {}
void ProgressBar::finish() {}
double ProgressBar::now() const { return 0; }
std::string ProgressBar::line(bool) const { return {}; }

}  // namespace tessera::trainer
