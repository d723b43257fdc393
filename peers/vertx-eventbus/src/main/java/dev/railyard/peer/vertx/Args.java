package dev.railyard.peer.vertx;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;

/** Minimal {@code --name value} parser; every option takes exactly one value. */
public final class Args {

  private final Map<String, String> values;

  private Args(Map<String, String> values) {
    this.values = values;
  }

  public static Args parse(String[] argv) {
    Map<String, String> values = new LinkedHashMap<>();
    for (int i = 0; i < argv.length; i++) {
      String a = argv[i];
      if (!a.startsWith("--") || a.length() == 2) {
        throw new UsageException("unexpected argument '" + a + "'");
      }
      String name;
      String value;
      int eq = a.indexOf('=');
      if (eq > 0) {
        name = a.substring(2, eq);
        value = a.substring(eq + 1);
      } else {
        if (i + 1 >= argv.length) {
          throw new UsageException("option --" + a.substring(2) + " needs a value");
        }
        name = a.substring(2);
        value = argv[++i];
      }
      if (values.put(name, value) != null) {
        throw new UsageException("option --" + name + " given twice");
      }
    }
    return new Args(values);
  }

  /** Fails on any option not in {@code allowed}. */
  public void allowOnly(Set<String> allowed) {
    for (String name : values.keySet()) {
      if (!allowed.contains(name)) {
        throw new UsageException("unknown option --" + name);
      }
    }
  }

  /** The options as {@code --name value} pairs, in the given order, minus {@code excluded}. */
  public List<String> toArgv(Set<String> excluded) {
    List<String> argv = new ArrayList<>();
    for (Map.Entry<String, String> e : values.entrySet()) {
      if (!excluded.contains(e.getKey())) {
        argv.add("--" + e.getKey());
        argv.add(e.getValue());
      }
    }
    return argv;
  }

  public String string(String name, String def) {
    String v = values.get(name);
    return v == null ? def : v;
  }

  public String choice(String name, String def, String... allowed) {
    String v = string(name, def);
    for (String a : allowed) {
      if (a.equals(v)) {
        return v;
      }
    }
    throw new UsageException("--" + name + " must be one of " + String.join("|", allowed) + ", got '" + v + "'");
  }

  public long positiveLong(String name, long def) {
    String v = values.get(name);
    if (v == null) {
      return def;
    }
    long n;
    try {
      n = Long.parseLong(v.replace("_", ""));
    } catch (NumberFormatException e) {
      throw new UsageException("--" + name + " must be an integer, got '" + v + "'");
    }
    if (n <= 0) {
      throw new UsageException("--" + name + " must be > 0, got " + n);
    }
    return n;
  }

  /** Seconds, possibly fractional, {@code >= min}. */
  public double seconds(String name, double def, double min) {
    String v = values.get(name);
    if (v == null) {
      return def;
    }
    double d;
    try {
      d = Double.parseDouble(v);
    } catch (NumberFormatException e) {
      throw new UsageException("--" + name + " must be a number of seconds, got '" + v + "'");
    }
    if (!Double.isFinite(d) || d < min) {
      throw new UsageException("--" + name + " must be a finite number >= " + min + ", got '" + v + "'");
    }
    return d;
  }
}
